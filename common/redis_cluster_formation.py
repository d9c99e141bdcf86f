"""The formation of a Redis Cluster of running, empty nodes, and watching it heal.

``Cluster`` talks to nodes it did not start (the Kubernetes init Job's, compose's, or
``common.redis_cluster``'s local servers) as the operator user: each primary takes an
even range of the 16384 slots (``CLUSTER ADDSLOTSRANGE``), every node meets the first
(``CLUSTER MEET``), each replica follows its primary (``CLUSTER REPLICATE``), and
formation returns once every node reports ``cluster_state:ok`` and every replica's
link to its primary is up. ``wait_replicated``, ``primary_of`` and ``wait_promoted``
watch a failover.

``create`` is ``python -m common.redis_cluster create HOST:PORT ...`` (``--help``):
it forms a cluster of running empty nodes, or re-meets a formed one.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis import Redis
from redis.crc import key_slot
from redis.exceptions import RedisError

from common.redis_acl import ADMIN_USER
from common.redis_nodes import parse_node
from common.service_auth import read_secret_file

NUM_SLOTS = 16384


class ClusterStartError(RuntimeError):
    """The cluster did not form (or heal) in time."""


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
