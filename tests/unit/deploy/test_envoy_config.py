"""deploy/envoy/envoy.yaml and its rendered variants, checked offline.

`envoy --mode validate` loads each config the way a real start would (every
field, every extension, the descriptor set); the structural checks pin the
behaviour the edge must have (timeouts, retries, ejection, admin on loopback).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor_pb2

from common.addresses import host_of, is_loopback
from common.config import ROOT
from deploy.envoy import config as envoy_config
from deploy.envoy.config import (
    CONTAINER_PRESET,
    ENVOY_YAML,
    Endpoint,
    admin_socket_path,
    cluster,
    cluster_endpoints,
    http_connection_manager,
    http_filter,
    listener,
    load_config,
    render_config,
    render_config_file,
    tls_context,
)
from deploy.envoy.process import envoy_binary
from deploy.envoy.tls import TlsFiles, ensure_local_tls
from tests.unit.deploy.helpers import DESCRIPTOR_SET, ENVOY_PUBLIC_PORT

TRANSCODER = "envoy.filters.http.grpc_json_transcoder"


@pytest.fixture(scope="module")
def descriptor() -> Path:
    if not DESCRIPTOR_SET.exists():
        pytest.fail(f"{DESCRIPTOR_SET} missing: run `make protos` (make test does it)")
    return DESCRIPTOR_SET


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return ensure_local_tls(tmp_path_factory.mktemp("tls"))


def envoy_validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def routes(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Routes of the public listener by match prefix (or path)."""
    vhosts = http_connection_manager(config)["route_config"]["virtual_hosts"]
    out = {}
    for vh in vhosts:
        for r in vh["routes"]:
            out[r["match"].get("prefix") or r["match"].get("path")] = r
    return out


def test_envoy_validates_the_file_as_written(descriptor: Path, tmp_path: Path) -> None:
    # the file as written names build/llm_v1.pb and make run's .run/tls/ relative to
    # the repo root (validation reads the certificate and key): a tree of those
    (tmp_path / "build").symlink_to(descriptor.parent)
    ensure_local_tls(tmp_path / ".run" / "tls")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(ENVOY_YAML)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr
    assert "deprecated" not in (result.stdout + result.stderr).lower()


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "listener_port": 0,
            "admin_port": 0,
            "gateway": ["127.0.0.1:1", "127.0.0.1:2"],
            "admin": ["127.0.0.1:3"],
            "gateway_http": ["127.0.0.1:4"],
            "listener_host": "127.0.0.1",
            "plaintext": True,
        },
        {**CONTAINER_PRESET, "proto_descriptor": str(DESCRIPTOR_SET)},
        {
            "listener_port": 18080,
            "admin_port": 19901,
            "stats_port": 19902,
            "access_log_path": "/dev/null",
        },
    ],
    ids=["tests-plaintext", "container", "make-run-shifted"],
)
def test_envoy_validates_rendered_variants(
    descriptor: Path, tmp_path: Path, tls: TlsFiles, overrides: dict[str, Any]
) -> None:
    # the container's /etc/envoy/tls is not here: this machine's files stand in
    files = {} if overrides.get("plaintext") else {"tls_cert": tls.cert, "tls_key": tls.key}
    path = render_config_file(tmp_path / "envoy.yaml", **{**overrides, **files})
    result = envoy_validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_validate_rejects_a_broken_variant(descriptor: Path, tmp_path: Path) -> None:
    cfg = render_config()
    cluster(cfg, "gateway")["outlier_detection"]["enforcing_consecutive_5xx"] = 101
    path = envoy_config.write_config(cfg, tmp_path / "bad.yaml")
    result = envoy_validate(path)
    assert result.returncode != 0
    assert "enforcing_consecutive_5xx" in result.stdout + result.stderr


def test_as_written_is_the_make_run_layout() -> None:
    cfg = load_config()
    # the admin interface: a unix socket only Envoy's user may open, never TCP
    assert cfg["admin"]["address"] == {"pipe": {"path": ".run/envoy-admin.sock", "mode": 0o600}}
    assert listener(cfg, "public")["address"]["socket_address"]["port_value"] == ENVOY_PUBLIC_PORT
    assert cluster_endpoints(cfg, "gateway") == [Endpoint("127.0.0.1", 50051)]
    assert cluster_endpoints(cfg, "admin") == [Endpoint("127.0.0.1", 50051)]
    assert cluster_endpoints(cfg, "gateway_http") == [Endpoint("127.0.0.1", 8000)]
    (admin_host,) = cluster(cfg, "envoy_admin")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert admin_host["endpoint"]["address"] == {"pipe": {"path": ".run/envoy-admin.sock"}}


def test_public_listener_terminates_modern_tls() -> None:
    cfg = load_config()
    (chain,) = listener(cfg, "public")["filter_chains"]
    assert chain["transport_socket"]["name"] == "envoy.transport_sockets.tls"
    assert chain["transport_socket_connect_timeout"] == "10s"  # no half-open handshakes
    common = tls_context(cfg)["common_tls_context"]
    assert common["alpn_protocols"] == ["h2", "http/1.1"]  # gRPC needs h2 by ALPN
    params = common["tls_params"]
    assert params["tls_minimum_protocol_version"] == "TLSv1_2"
    assert params["tls_maximum_protocol_version"] == "TLSv1_3"
    for suite in params["cipher_suites"]:  # forward secrecy and AEAD only
        assert suite.startswith("ECDHE-"), suite
        assert "GCM" in suite or "CHACHA20-POLY1305" in suite, suite
    (certificate,) = common["tls_certificates"]
    assert certificate["certificate_chain"]["filename"] == ".run/tls/tls.crt"  # make run's
    assert certificate["private_key"]["filename"] == ".run/tls/tls.key"
    # the stats listener (plaintext) is loopback in make run's file
    assert listener(cfg, "stats")["address"]["socket_address"]["address"] == "127.0.0.1"


def test_render_sets_the_certificate_or_plaintext_on_loopback_only(tmp_path: Path) -> None:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    (certificate,) = tls_context(render_config(tls_cert=cert, tls_key=key))["common_tls_context"][
        "tls_certificates"
    ]
    assert certificate == {
        "certificate_chain": {"filename": str(cert)},
        "private_key": {"filename": str(key)},
    }
    (default,) = tls_context(render_config())["common_tls_context"]["tls_certificates"]
    assert default["private_key"]["filename"] == str(ROOT / ".run/tls/tls.key")  # any cwd
    for host in ("127.0.0.1", "::1", "localhost"):
        plain = render_config(listener_host=host, plaintext=True)
        with pytest.raises(KeyError, match="no TLS"):
            tls_context(plain)
        assert "transport_socket" not in str(listener(plain, "public"))
    for host in ("0.0.0.0", "10.0.0.5", "::", "gateway.example.com"):
        with pytest.raises(ValueError, match="loopback"):
            render_config(listener_host=host, plaintext=True)
    with pytest.raises(ValueError, match="loopback"):  # the file's own 0.0.0.0
        render_config(plaintext=True)
    with pytest.raises(ValueError, match="loopback"):
        envoy_config.main(["--preset", "container", "--plaintext", "-o", str(tmp_path / "x")])


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "LOCALHOST."):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.1.2.3", "localhost.example.com", "gateway", ""):
        assert not is_loopback(host), host
    assert host_of("127.0.0.1:8080") == "127.0.0.1"
    assert host_of("[::1]:8080") == "::1"
    assert host_of("::1") == "::1"
    assert host_of("llm.example.com") == "llm.example.com"


def test_generate_route_streams_without_a_route_timeout() -> None:
    cfg = load_config()
    route = routes(cfg)["/llm.v1.Gateway/"]["route"]
    assert route["cluster"] == "gateway"
    assert route["timeout"] == "0s"  # Envoy's 15 s default would cut long generations
    assert route["max_stream_duration"]["grpc_timeout_header_max"] == "0s"  # client deadline
    assert route["idle_timeout"] not in ("0s", None)
    hcm = http_connection_manager(cfg)
    assert hcm["stream_idle_timeout"] not in ("0s", None)
    # slow uploads are cut; the timer stops once the request is in (never cuts a stream:
    # tests/integration/deploy/test_envoy_retries.py)
    assert hcm["request_timeout"] == "60s"
    assert hcm["request_headers_timeout"] == "10s"


def test_retries_only_before_the_response_starts() -> None:
    cfg = load_config()
    by_prefix = routes(cfg)
    gen = by_prefix["/llm.v1.Gateway/"]["route"]["retry_policy"]
    assert set(gen["retry_on"].split(",")) == {"connect-failure", "refused-stream", "unavailable"}
    assert "per_try_timeout" not in gen  # a per-try timeout would abort a live stream
    assert "retriable_status_codes" not in gen
    assert any(
        p["name"] == "envoy.retry_host_predicates.previous_hosts"
        for p in gen["retry_host_predicate"]
    )
    admin = by_prefix["/llm.v1.RateLimitAdmin/"]["route"]["retry_policy"]
    # CreateApiKey is not idempotent: only retry what cannot have reached the service
    assert set(admin["retry_on"].split(",")) == {"connect-failure", "refused-stream"}
    routing = by_prefix["/llm.v1.RoutingAdmin/"]["route"]
    assert routing["cluster"] == "gateway"  # only the gateway serves RoutingAdmin
    assert set(routing["retry_policy"]["retry_on"].split(",")) == {
        "connect-failure",
        "refused-stream",
    }


@pytest.mark.parametrize(
    ("name", "service"), [("gateway", "llm.v1.Gateway"), ("admin", "llm.v1.RateLimitAdmin")]
)
def test_upstream_clusters_are_h2_health_checked_and_eject(name: str, service: str) -> None:
    cl = cluster(load_config(), name)
    h2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    opts = cl["typed_extension_protocol_options"][h2]
    assert "http2_protocol_options" in opts["explicit_http_config"]
    (hc,) = cl["health_checks"]
    assert hc["grpc_health_check"]["service_name"] == service
    od = cl["outlier_detection"]
    assert od["enforcing_consecutive_5xx"] == 100
    assert od["enforcing_consecutive_gateway_failure"] == 100
    assert od["consecutive_gateway_failure"] >= 1
    assert 0 < od["max_ejection_percent"] < 100  # never eject the whole fleet


def test_transcoder_serves_only_the_admin_api(descriptor: Path) -> None:
    cfg = render_config()
    tc = http_filter(cfg, TRANSCODER)
    assert tc["services"] == ["llm.v1.RateLimitAdmin", "llm.v1.RoutingAdmin"]
    assert tc["convert_grpc_status"] is True
    assert tc["print_options"]["preserve_proto_field_names"] is True
    assert Path(tc["proto_descriptor"]) == descriptor  # made absolute by the renderer
    names = [f["name"] for f in http_connection_manager(cfg)["http_filters"]]
    assert names[-1] == "envoy.filters.http.router"


def test_descriptor_set_carries_the_admin_http_rules(descriptor: Path) -> None:
    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor.read_bytes())
    by_name = {f.name: f for f in fds.file}
    assert "google/api/annotations.proto" in by_name  # --include_imports
    (svc,) = [s for s in by_name["llm/v1/admin.proto"].service if s.name == "RateLimitAdmin"]
    paths = {}
    for method in svc.method:
        opts = descriptor_pb2.MethodOptions.FromString(method.options.SerializeToString())
        rule = http_pb2.HttpRule()
        rule.CopyFrom(opts.Extensions[annotations_pb2.http])
        pattern = rule.WhichOneof("pattern")
        assert pattern is not None, f"{method.name} has no google.api.http rule"
        paths[method.name] = (pattern, getattr(rule, pattern))
    assert all(p.startswith("/v1/admin/") for _, p in paths.values()), paths
    assert paths["UpsertTenant"] == ("put", "/v1/admin/tenants/{id}")
    assert paths["GetTenant"] == ("get", "/v1/admin/tenants/{tenant_id}")


def test_descriptor_set_carries_the_routing_admin_http_rules(descriptor: Path) -> None:
    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor.read_bytes())
    (admin,) = [f for f in fds.file if f.name == "llm/v1/admin.proto"]
    (svc,) = [s for s in admin.service if s.name == "RoutingAdmin"]
    paths = {}
    for method in svc.method:
        opts = descriptor_pb2.MethodOptions.FromString(method.options.SerializeToString())
        rule = http_pb2.HttpRule()
        rule.CopyFrom(opts.Extensions[annotations_pb2.http])
        pattern = rule.WhichOneof("pattern")
        assert pattern is not None, f"{method.name} has no google.api.http rule"
        paths[method.name] = (pattern, getattr(rule, pattern))
    assert all(p.startswith(("/v1/admin/models", "/v1/admin/routes")) for _, p in paths.values())
    assert paths["SetRoutingPolicy"] == ("put", "/v1/admin/models/{model}/routing")
    assert paths["Rollback"] == ("post", "/v1/admin/models/{model}/rollback")
    assert paths["ListModelRoutes"] == ("get", "/v1/admin/routes")
    assert paths["SetModelRoute"] == ("put", "/v1/admin/routes/{name}")
    assert paths["DeleteModelRoute"] == ("delete", "/v1/admin/routes/{name}")


def test_access_log_is_json_with_request_id_and_grpc_status() -> None:
    hcm = http_connection_manager(load_config())
    (log,) = hcm["access_log"]
    fmt = log["typed_config"]["log_format"]["json_format"]
    assert fmt["request_id"] == "%REQ(X-REQUEST-ID)%"
    assert fmt["grpc_status"] == "%GRPC_STATUS%"
    assert not any("AUTHORIZATION" in str(v).upper() for v in fmt.values())
    assert hcm["generate_request_id"] is True
    assert hcm["preserve_external_request_id"] is True
    assert hcm["request_id_extension"]["typed_config"]["pack_trace_reason"] is False


def test_render_replaces_only_what_it_is_given(tmp_path: Path) -> None:
    before = ENVOY_YAML.read_text()
    cfg = render_config(
        listener_host="127.0.0.1",
        listener_port=0,
        admin_port=0,
        gateway=["127.0.0.1:7001", ("127.0.0.1", 7002)],
        admin=["10.0.0.5:7003"],
        access_log_path=tmp_path / "a.log",
    )
    assert ENVOY_YAML.read_text() == before
    assert listener(cfg, "public")["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 0,
    }
    socket = admin_socket_path(cfg)  # admin_port (old callers): a private socket
    assert socket.name == "admin.sock"
    assert socket.parent.stat().st_mode & 0o777 == 0o700
    assert cluster_endpoints(cfg, "gateway") == [
        Endpoint("127.0.0.1", 7001),
        Endpoint("127.0.0.1", 7002),
    ]
    assert cluster_endpoints(cfg, "admin") == [Endpoint("10.0.0.5", 7003)]
    assert cluster_endpoints(cfg, "gateway_http") == [Endpoint("127.0.0.1", 8000)]  # kept
    http = render_config(gateway_http=["127.0.0.1:7004"])
    assert cluster_endpoints(http, "gateway_http") == [Endpoint("127.0.0.1", 7004)]
    # the YAML anchors are unshared: the admin cluster kept its own health check
    assert cluster(cfg, "admin")["health_checks"][0]["grpc_health_check"]["service_name"] == (
        "llm.v1.RateLimitAdmin"
    )
    # an ephemeral admin port cannot be proxied to: the stats listener goes
    names = [item["name"] for item in cfg["static_resources"]["listeners"]]
    assert names == ["public"]
    (log,) = http_connection_manager(cfg)["access_log"]
    assert log["typed_config"]["path"] == str(tmp_path / "a.log")


def test_render_picks_static_for_ips_and_dns_for_names() -> None:
    assert cluster(render_config(gateway=["127.0.0.1:1"]), "gateway")["type"] == "STATIC"
    dns = cluster(render_config(gateway=["gateway:50051"]), "gateway")
    assert dns["type"] == "STRICT_DNS"
    assert dns["dns_lookup_family"] == "V4_ONLY"


def test_render_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="host:port"):
        render_config(gateway=["no-port"])
    with pytest.raises(ValueError, match="at least one endpoint"):
        render_config(gateway=[])


def test_container_preset_keeps_admin_on_loopback(tmp_path: Path) -> None:
    out = tmp_path / "envoy.yaml"
    assert envoy_config.main(["--preset", "container", "-o", str(out)]) == 0
    cfg = load_config(out)
    assert cfg["admin"]["address"] == {"pipe": {"path": "/tmp/envoy-admin.sock", "mode": 0o600}}
    assert listener(cfg, "public")["address"]["socket_address"]["address"] == "0.0.0.0"
    assert cluster_endpoints(cfg, "gateway") == [Endpoint("gateway", 50051)]
    assert cluster_endpoints(cfg, "gateway_http") == [Endpoint("gateway", 8000)]
    assert http_filter(cfg, TRANSCODER)["proto_descriptor"] == "/etc/envoy/llm_v1.pb"
    (certificate,) = tls_context(cfg)["common_tls_context"]["tls_certificates"]
    assert certificate["certificate_chain"]["filename"] == "/etc/envoy/tls/tls.crt"
    stats = listener(cfg, "stats")
    # probes and Prometheus reach the pod's address
    assert stats["address"]["socket_address"] == {"address": "0.0.0.0", "port_value": 9902}
    vhost = stats["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    paths = {r["match"]["path"] for r in vhost["virtual_hosts"][0]["routes"]}
    assert paths == {"/stats/prometheus", "/ready"}  # nothing else of the admin API


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_openai_routes_stream_to_the_gateway_http_port(path: str) -> None:
    by_match = routes(load_config())
    r = by_match[path]
    route = r["route"]
    assert route["cluster"] == "gateway_http"
    assert route["timeout"] == "0s"  # SSE streams as long as the generation runs
    assert route["idle_timeout"] not in ("0s", None)
    assert "per_try_timeout" not in route["retry_policy"]  # would cut a live stream
    assert set(route["retry_policy"]["retry_on"].split(",")) == {
        "connect-failure",
        "refused-stream",
        "retriable-status-codes",
    }
    assert route["retry_policy"]["retriable_status_codes"] == [503]
    # nothing on the route may buffer: the transcoder is switched off there
    per_filter = r["typed_per_filter_config"][TRANSCODER]
    assert per_filter["disabled"] is True
    assert by_match["/v1/models"]["match"] == {"prefix": "/v1/models"}  # and /v1/models/{id}


def test_public_listener_has_no_buffering_filter() -> None:
    names = [f["name"] for f in http_connection_manager(load_config())["http_filters"]]
    assert names == [TRANSCODER, "envoy.filters.http.router"]
    assert not any("buffer" in n or "compressor" in n for n in names)


def test_gateway_http_cluster_is_http1_and_health_checked() -> None:
    cl = cluster(load_config(), "gateway_http")
    opts = cl["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert "http_protocol_options" in opts["explicit_http_config"]  # aiohttp speaks HTTP/1.1
    (hc,) = cl["health_checks"]
    assert hc["http_health_check"]["path"] == "/health"  # 503 while the gateway drains
    assert cl["outlier_detection"]["enforcing_consecutive_5xx"] == 100
    assert 0 < cl["outlier_detection"]["max_ejection_percent"] < 100
