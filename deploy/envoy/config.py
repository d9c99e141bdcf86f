"""Render variants of deploy/envoy/envoy.yaml without keeping a second copy of it.

envoy.yaml as written is the `make run` configuration (loopback upstreams,
listener :8080, admin on the unix socket .run/envoy-admin.sock). Everything else (tests on ephemeral
ports, the container image, Kubernetes) starts from that file and replaces
only what differs:

    listener_host / listener_port   the public listener ("public")
    tls_cert / tls_key              its certificate chain and private key (PEM);
                                    the file names make run's (.run/tls/)
    plaintext                       no TLS on the public listener: only when it is
                                    bound to a loopback address (tests, benchmarks)
    stats_port                      the Prometheus listener ("stats"), same host
    admin_socket                    Envoy's admin interface: a unix socket, mode 0600
                                    (never TCP: the admin API can stop Envoy, change
                                    its log level, runtime and more, unauthenticated)
    admin_port                      for old callers: any value gives the admin
                                    interface a fresh private socket (a new 0700
                                    directory) and, without stats_port, drops the
                                    stats listener
    gateway / admin                 endpoints of the "gateway" / "admin" clusters
                                    (STATIC when all are IPs, else STRICT_DNS)
    gateway_http                    endpoints of the "gateway_http" cluster: the
                                    gateways' OpenAI-compatible HTTP port
    proto_descriptor                the descriptor set the transcoder reads
    access_log_path                 where the JSON access log goes

Port 0 means "pick a free one": Envoy binds an ephemeral port, and
``EnvoyProcess`` reads the bound ports back from the admin interface (over its
socket, whose path it reads from the config).

Command line (used by deploy/docker/envoy.Dockerfile):

    python -m deploy.envoy.config --preset container -o /etc/envoy/envoy.yaml
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from common.addresses import is_loopback
from common.config import ROOT

ENVOY_YAML = Path(__file__).resolve().parent / "envoy.yaml"
ADMIN_SOCKET_MODE = 0o600  # only Envoy's own user: the admin API can stop Envoy
ADMIN_SOCKET_NAME = "admin.sock"
PRIVATE_SOCKET_PREFIX = "envoy-admin-"  # the directories of private_admin_socket()
CONTAINER_TLS_DIR = "/etc/envoy/tls"  # a kubernetes.io/tls Secret or a directory, mounted

PUBLIC_LISTENER = "public"
STATS_LISTENER = "stats"
GATEWAY_CLUSTER = "gateway"
GATEWAY_HTTP_CLUSTER = "gateway_http"
ADMIN_CLUSTER = "admin"
ENVOY_ADMIN_CLUSTER = "envoy_admin"
TRANSCODER = "envoy.filters.http.grpc_json_transcoder"
HCM = "envoy.filters.network.http_connection_manager"

Config = dict[str, Any]


@dataclass(slots=True)
class EnvoyConfig:
    """The ``envoy`` section of the stack config: where ``make run``'s Envoy listens.

    Attributes:
        host: Address of the public listener.
        port: The public listener (TLS): gRPC, the OpenAI HTTP API and the
            ``/v1/admin/`` HTTP/JSON API.
        admin_socket: Envoy's admin interface: a unix socket (mode 0600, relative
            paths against the repository root), never a TCP port.
    """

    host: str = "0.0.0.0"
    port: int = 8080
    admin_socket: str = ".run/envoy-admin.sock"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One upstream address."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: str | tuple[str, int] | Endpoint) -> Endpoint:
        """Accepts ``Endpoint``, ``(host, port)`` or ``"host:port"``."""
        if isinstance(value, Endpoint):
            return value
        if isinstance(value, tuple):
            return cls(value[0], int(value[1]))
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected host:port, got {value!r}")
        return cls(host, int(port))


EndpointLike = str | tuple[str, int] | Endpoint

# What the container image bakes in: compose and Kubernetes both name the
# gateway replicas "gateway" (a headless Service in Kubernetes, so DNS returns
# every pod and Envoy health-checks and ejects each replica on its own).
CONTAINER_PRESET: dict[str, Any] = {
    "listener_host": "0.0.0.0",
    "stats_port": 9902,  # on every address too: probes and Prometheus reach the pod's
    "tls_cert": f"{CONTAINER_TLS_DIR}/tls.crt",
    "tls_key": f"{CONTAINER_TLS_DIR}/tls.key",
    "gateway": ["gateway:50051"],
    "gateway_http": ["gateway:8000"],
    "admin": ["gateway:50051"],
    "admin_socket": "/tmp/envoy-admin.sock",  # /tmp: the one directory Envoy's user may write
    "proto_descriptor": "/etc/envoy/llm_v1.pb",
    "access_log_path": "/dev/stdout",
}


def load_config(path: str | Path = ENVOY_YAML) -> Config:
    """The parsed config, as plain dicts and lists with no shared (aliased) nodes.

    envoy.yaml uses YAML anchors; a JSON round trip gives every alias its own
    copy, so changing one cluster never changes another.
    """
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    copied: Config = json.loads(json.dumps(doc))
    return copied


def listener(config: Config, name: str) -> Config:
    for item in config["static_resources"]["listeners"]:
        if item["name"] == name:
            found: Config = item
            return found
    raise KeyError(f"no listener named {name!r}")


def cluster(config: Config, name: str) -> Config:
    for item in config["static_resources"]["clusters"]:
        if item["name"] == name:
            found: Config = item
            return found
    raise KeyError(f"no cluster named {name!r}")


def http_connection_manager(config: Config, listener_name: str = PUBLIC_LISTENER) -> Config:
    for chain in listener(config, listener_name)["filter_chains"]:
        for flt in chain["filters"]:
            if flt["name"] == HCM:
                hcm: Config = flt["typed_config"]
                return hcm
    raise KeyError(f"listener {listener_name!r} has no HTTP connection manager")


def http_filter(config: Config, filter_name: str, listener_name: str = PUBLIC_LISTENER) -> Config:
    for flt in http_connection_manager(config, listener_name)["http_filters"]:
        if flt["name"] == filter_name:
            typed: Config = flt["typed_config"]
            return typed
    raise KeyError(f"listener {listener_name!r} has no HTTP filter {filter_name!r}")


def tls_context(config: Config, listener_name: str = PUBLIC_LISTENER) -> Config:
    """The DownstreamTlsContext of a listener; KeyError when it is plaintext."""
    for chain in listener(config, listener_name)["filter_chains"]:
        if "transport_socket" in chain:
            ctx: Config = chain["transport_socket"]["typed_config"]
            return ctx
    raise KeyError(f"listener {listener_name!r} has no TLS")


def cluster_endpoints(config: Config, name: str) -> list[Endpoint]:
    """Every endpoint address of a static/DNS cluster."""
    out = []
    for locality in cluster(config, name)["load_assignment"]["endpoints"]:
        for lb in locality["lb_endpoints"]:
            sock = lb["endpoint"]["address"]["socket_address"]
            out.append(Endpoint(sock["address"], int(sock["port_value"])))
    return out


def admin_socket_path(config: Config) -> Path:
    """The unix socket of a rendered config's admin interface."""
    return Path(config["admin"]["address"]["pipe"]["path"])


def _set_admin(config: Config, path: Path) -> None:
    """The admin interface, and the stats listener's way to it, on the socket ``path``."""
    pipe = {"pipe": {"path": str(path), "mode": ADMIN_SOCKET_MODE}}
    config["admin"]["address"] = pipe
    for item in config["static_resources"]["clusters"]:
        if item["name"] == ENVOY_ADMIN_CLUSTER:
            (locality,) = item["load_assignment"]["endpoints"]
            (lb,) = locality["lb_endpoints"]
            lb["endpoint"]["address"] = {"pipe": {"path": str(path)}}


def private_admin_socket() -> Path:
    """A socket path in a new directory only this user may enter (mode 0700), short
    enough for a unix socket (108 bytes) wherever the caller keeps its files."""
    return Path(tempfile.mkdtemp(prefix=PRIVATE_SOCKET_PREFIX)) / ADMIN_SOCKET_NAME


def _set_socket(target: Config, host: str | None, port: int | None) -> None:
    sock = target["address"]["socket_address"]
    if host is not None:
        sock["address"] = host
    if port is not None:
        sock["port_value"] = int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _set_endpoints(config: Config, name: str, endpoints: Sequence[EndpointLike]) -> None:
    parsed = [Endpoint.parse(e) for e in endpoints]
    if not parsed:
        raise ValueError(f"cluster {name!r} needs at least one endpoint")
    cl = cluster(config, name)
    if all(_is_ip(e.host) for e in parsed):
        cl["type"] = "STATIC"
        cl.pop("dns_lookup_family", None)
    else:
        cl["type"] = "STRICT_DNS"
        cl["dns_lookup_family"] = "V4_ONLY"
    cl["load_assignment"]["endpoints"] = [
        {
            "lb_endpoints": [
                {
                    "endpoint": {
                        "address": {"socket_address": {"address": e.host, "port_value": e.port}}
                    }
                }
                for e in parsed
            ]
        }
    ]


def _absolute(path: str | Path) -> str:
    """A relative path in the config (build/..., .run/...) against the repository root."""
    out = Path(path)
    return str(out if out.is_absolute() else ROOT / out)


def _set_tls(config: Config, cert: str | Path | None, key: str | Path | None, plain: bool) -> None:
    public = listener(config, PUBLIC_LISTENER)
    if plain:
        host = public["address"]["socket_address"]["address"]
        if not is_loopback(host):
            raise ValueError(
                f"plaintext is for a loopback listener only; {host!r} is not one "
                "(give tls_cert and tls_key instead)"
            )
        for chain in public["filter_chains"]:
            chain.pop("transport_socket", None)
            chain.pop("transport_socket_connect_timeout", None)
        return
    (certificate,) = tls_context(config)["common_tls_context"]["tls_certificates"]
    for field, given in (("certificate_chain", cert), ("private_key", key)):
        certificate[field]["filename"] = _absolute(given or certificate[field]["filename"])


def _drop(config: Config, kind: str, name: str) -> None:
    items = config["static_resources"][kind]
    config["static_resources"][kind] = [i for i in items if i["name"] != name]


def _set_access_log(config: Config, path: str) -> None:
    for log in http_connection_manager(config)["access_log"]:
        log["typed_config"]["path"] = path


def render_config(
    *,
    listener_host: str | None = None,
    listener_port: int | None = None,
    admin_socket: str | Path | None = None,
    admin_port: int | None = None,
    stats_port: int | None = None,
    gateway: Sequence[EndpointLike] | None = None,
    admin: Sequence[EndpointLike] | None = None,
    gateway_http: Sequence[EndpointLike] | None = None,
    proto_descriptor: str | Path | None = None,
    access_log_path: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    plaintext: bool = False,
    base: str | Path = ENVOY_YAML,
) -> Config:
    """envoy.yaml with the given parts replaced; ``None`` keeps what the file says.

    Relative paths (the file's ``build/llm_v1.pb``, ``.run/tls/tls.crt`` and
    ``.run/envoy-admin.sock``) are made absolute against the repository root, so
    the result works from any cwd. ``plaintext=True`` drops TLS from the public listener, and is
    refused unless that listener is bound to a loopback address.
    """
    config = load_config(base)
    _set_socket(listener(config, PUBLIC_LISTENER), listener_host, listener_port)
    _set_tls(config, tls_cert, tls_key, plaintext)
    if stats_port is not None:
        _set_socket(listener(config, STATS_LISTENER), listener_host, stats_port)
    if admin_socket is not None:
        socket_path = Path(_absolute(admin_socket))
    elif admin_port is not None:
        socket_path = private_admin_socket()
    else:
        socket_path = Path(_absolute(admin_socket_path(config)))
    _set_admin(config, socket_path)
    if admin_port is not None and stats_port is None:
        # an Envoy of its own (a test's, a bench's): no fixed stats port to collide on
        _drop(config, "listeners", STATS_LISTENER)
        _drop(config, "clusters", ENVOY_ADMIN_CLUSTER)
    if gateway is not None:
        _set_endpoints(config, GATEWAY_CLUSTER, gateway)
    if admin is not None:
        _set_endpoints(config, ADMIN_CLUSTER, admin)
    if gateway_http is not None:
        _set_endpoints(config, GATEWAY_HTTP_CLUSTER, gateway_http)
    transcoder = http_filter(config, TRANSCODER)
    transcoder["proto_descriptor"] = _absolute(proto_descriptor or transcoder["proto_descriptor"])
    if access_log_path is not None:
        _set_access_log(config, str(access_log_path))
    return config


def write_config(config: Config, path: str | Path | None = None) -> Path:
    """Write ``config`` as YAML to ``path`` (a new temporary file when ``None``)."""
    if path is None:
        fd, name = tempfile.mkstemp(prefix="envoy-", suffix=".yaml")
        os.close(fd)
        path = name
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = "# Rendered from deploy/envoy/envoy.yaml by deploy.envoy.config; do not edit.\n"
    out.write_text(header + yaml.safe_dump(config, sort_keys=False, width=100))
    return out


def render_config_file(path: str | Path | None = None, **overrides: Any) -> Path:
    """``render_config(**overrides)`` written to ``path`` (or a temp file); returns the path."""
    return write_config(render_config(**overrides), path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.envoy.config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--preset",
        choices=["local", "container"],
        default="local",
        help="local = envoy.yaml as written; container = compose/Kubernetes",
    )
    parser.add_argument("--listen", help="host:port of the public listener")
    parser.add_argument("--admin-socket", help="unix socket of the admin interface")
    parser.add_argument("--stats-port", type=int)
    parser.add_argument("--gateway", action="append", help="gateway endpoint host:port (repeat)")
    parser.add_argument("--admin", action="append", help="RateLimitAdmin endpoint (repeat)")
    parser.add_argument(
        "--gateway-http",
        action="append",
        help="gateway OpenAI-compatible HTTP endpoint host:port (repeat)",
    )
    parser.add_argument("--descriptor", help="proto descriptor set path")
    parser.add_argument("--access-log", help="access log path (default /dev/stdout)")
    parser.add_argument("--tls-cert", help="certificate chain (PEM) of the public listener")
    parser.add_argument("--tls-key", help="its private key (PEM)")
    parser.add_argument(
        "--plaintext",
        action="store_true",
        help="no TLS on the public listener (refused unless --listen is a loopback address)",
    )
    parser.add_argument("-o", "--output", required=True, help="where to write the YAML")
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = dict(CONTAINER_PRESET) if args.preset == "container" else {}
    if args.listen:
        ep = Endpoint.parse(args.listen)
        overrides.update(listener_host=ep.host, listener_port=ep.port)
    for key, value in (
        ("admin_socket", args.admin_socket),
        ("stats_port", args.stats_port),
        ("gateway", args.gateway),
        ("admin", args.admin),
        ("gateway_http", args.gateway_http),
        ("proto_descriptor", args.descriptor),
        ("access_log_path", args.access_log),
        ("tls_cert", args.tls_cert),
        ("tls_key", args.tls_key),
    ):
        if value is not None:
            overrides[key] = value
    if args.plaintext:
        overrides["plaintext"] = True
    out = render_config_file(args.output, **overrides)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
