"""The stack's ACL on a real Redis Cluster (3 primaries, 1 replica each).

Every node runs ``common.redis_acl``'s cluster model: ``default`` off, the
service user on its keys plus the slot map, a replication user the replicas
sync with, an operator user that formed the cluster. Checked here: the
service user reads the slot map and nothing else of ``CLUSTER``, and is
refused every dangerous command with NOPERM, on every node and through the
cluster client; the replication user can do nothing but replicate; the
replicas hold what the primaries wrote; no node refused anything the stack
sent (its ACL log is empty); and ``python -m common.redis_cluster create`` (what
the Kubernetes init Job runs) forms a cluster of running ACL-protected nodes,
and a second run leaves it alone.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from redis import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from common.redis_acl import ADMIN_USER, REPLICATION_USER, acl_file
from common.redis_cluster import RedisClusterServers
from tests.integration.ratelimit.conftest import CLUSTER_KEY_PREFIX, acl_denials

pytestmark = pytest.mark.integration


def as_user(cluster: RedisClusterServers, i: int, username: str, password: str) -> Redis:
    """A plain client of node ``i`` as ``username``."""
    node = cluster.addresses[i]
    return Redis(
        host=node.host,
        port=node.port,
        username=username,
        password=password,
        socket_timeout=5,
        decode_responses=True,
    )


@pytest.fixture
def clean_acl_log(redis_cluster: RedisClusterServers) -> RedisClusterServers:
    for i in redis_cluster.live():
        with redis_cluster.client(i) as c:
            c.acl_log_reset()
    return redis_cluster


@pytest.fixture
async def service(redis_cluster: RedisClusterServers) -> AsyncIterator[RedisCluster]:
    client = RedisCluster.from_url(redis_cluster.service_url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


def test_every_node_runs_the_stacks_cluster_acl(redis_cluster: RedisClusterServers) -> None:
    assert redis_cluster.acl is not None
    expected = acl_file(redis_cluster.password, CLUSTER_KEY_PREFIX, cluster=redis_cluster.acl)
    for i, node in enumerate(redis_cluster.nodes):
        assert node.server.acl_path is not None
        assert node.server.acl_path.read_text() == expected
        assert redis_cluster.password not in expected  # hashes only
        with redis_cluster.client(i) as c:
            users = {line.split()[1]: line for line in c.acl_list()}
        assert set(users) == {"default", redis_cluster.username, REPLICATION_USER, ADMIN_USER}
        assert " off " in users["default"]
        anonymous = as_user(redis_cluster, i, "default", "")
        with anonymous, pytest.raises((AuthenticationError, ResponseError)):
            anonymous.ping()


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("CONFIG", "SET", "maxmemory", "1"),
        ("SCRIPT", "FLUSH"),
        ("FUNCTION", "FLUSH"),
        ("CLIENT", "KILL", "ID", "1"),
        ("SHUTDOWN", "NOSAVE"),
        ("KEYS", "*"),
        ("ACL", "LIST"),
        ("MONITOR",),
        ("REPLICAOF", "NO", "ONE"),
        ("CLUSTER", "RESET"),
        ("CLUSTER", "FAILOVER", "TAKEOVER"),
        ("CLUSTER", "FORGET", "0" * 40),
        ("CLUSTER", "MEET", "127.0.0.1", "1"),
        ("CLUSTER", "FLUSHSLOTS"),
        ("CLUSTER", "NODES"),
        ("SET", "other:key", "1"),
    ],
)
def test_the_service_user_is_refused_dangerous_commands_on_every_node(
    redis_cluster: RedisClusterServers, command: tuple[str, ...]
) -> None:
    for i in range(len(redis_cluster.nodes)):
        with as_user(redis_cluster, i, redis_cluster.username, redis_cluster.password) as c:
            with pytest.raises(NoPermissionError):
                c.execute_command(*command)  # type: ignore[no-untyped-call]
            assert c.ping()  # still up, the connection still usable
    assert redis_cluster.healthy()


@pytest.mark.parametrize("command", [("DEBUG", "SLEEP", "0"), ("CLUSTER", "INFO"), ("BGSAVE",)])
def test_the_acl_itself_refuses_what_the_server_may_refuse_anyway(
    redis_cluster: RedisClusterServers, command: tuple[str, ...]
) -> None:
    """DEBUG is off in the server's config too: ``ACL DRYRUN`` shows the ACL's own answer."""
    with redis_cluster.client(0) as c:
        answer = c.execute_command("ACL", "DRYRUN", redis_cluster.username, *command)  # type: ignore[no-untyped-call]
    assert "no permissions" in str(answer)


async def test_the_service_user_reads_the_slot_map_and_its_keys_only(
    redis_cluster: RedisClusterServers, service: RedisCluster, prefix: str
) -> None:
    with as_user(redis_cluster, 0, redis_cluster.username, redis_cluster.password) as c:
        slots = c.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
        shards = c.execute_command("CLUSTER", "SHARDS")  # type: ignore[no-untyped-call]
    assert len(slots) == len(shards) == redis_cluster.num_primaries
    await service.set(f"{prefix}{{a}}:x", "1")  # routed to the slot's primary
    assert await service.get(f"{prefix}{{a}}:x") == "1"
    with pytest.raises(NoPermissionError):  # through the cluster client as well
        await service.flushall()  # sent to every primary
    with pytest.raises(NoPermissionError):
        await service.config_get("*")
    with pytest.raises(NoPermissionError):
        await service.set("rl:{a}:x", "1")  # outside the user's keys (t*)


def test_the_replication_user_can_only_replicate(redis_cluster: RedisClusterServers) -> None:
    assert redis_cluster.acl is not None
    password = redis_cluster.acl.replication_password
    with as_user(redis_cluster, 0, REPLICATION_USER, password) as c:
        assert c.ping()
        for command in (("GET", f"{CLUSTER_KEY_PREFIX}x"), ("INFO",), ("CLUSTER", "SLOTS")):
            with pytest.raises(NoPermissionError):
                c.execute_command(*command)  # type: ignore[no-untyped-call]


async def test_the_replicas_hold_what_the_primaries_wrote(
    clean_acl_log: RedisClusterServers, service: RedisCluster, prefix: str
) -> None:
    cluster = clean_acl_log
    keys = {f"{prefix}{{tenant-{i}}}:tenant": str(i) for i in range(30)}
    for key, value in keys.items():
        await service.set(key, value)
    owners = {cluster.primary_of(k) for k in keys}
    assert owners == set(range(cluster.num_primaries))  # every shard got some
    cluster.wait_replicated()
    for i, node in enumerate(cluster.addresses):
        if node.primary is None:
            continue
        with cluster.client(i) as replica:
            info = replica.info("replication")
            assert (info["role"], info["master_link_status"]) == ("slave", "up")
            replica.execute_command("READONLY")  # type: ignore[no-untyped-call]
            mine = {k: v for k, v in keys.items() if cluster.primary_of(k) == node.primary}
            assert mine
            for key, value in mine.items():
                assert replica.get(key) == value
    assert acl_denials(cluster) == []  # the replicas' sync and the service's calls all passed


def test_create_forms_a_cluster_of_running_acl_nodes(tmp_path: Path) -> None:
    """What the Kubernetes init Job runs, on 2 primaries x 1 replica started without a
    cluster; a second run finds the cluster formed and changes nothing; after every
    node came back at a new address, a run joins them up again."""
    cluster = RedisClusterServers(
        2, 1, password="p" * 40, key_prefix=CLUSTER_KEY_PREFIX
    )  # servers only: formed below by the CLI
    with contextlib.closing(cluster):
        for node in cluster.nodes:
            node.server.start()
        assert cluster.acl is not None
        nodes = [f"{a.host}:{a.port}@{a.bus_port}" for a in cluster.addresses]

        def create(password: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
            password_file = tmp_path / "admin-password"
            password_file.write_text(password + "\n")
            cmd = [sys.executable, "-m", "common.redis_cluster", "create", "--replicas", "1"]
            cmd += ["--password-file", str(password_file), "--timeout", str(timeout), *nodes]
            return subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)

        refused = create("w" * 40, timeout=2)  # the operator's password is needed
        assert refused.returncode != 0
        assert "gave up waiting for the first node" in refused.stderr
        first = create(cluster.acl.admin_password)
        assert first.returncode == 0, first.stderr
        assert "redis cluster formed" in first.stdout
        assert cluster.healthy()
        assert [a.primary for a in cluster.addresses] == [None, None, 0, 1]
        for i, a in enumerate(cluster.addresses):
            with cluster.client(i) as c:
                role = c.info("replication")["role"]
            assert role == ("master" if a.primary is None else "slave")
        again = create(cluster.acl.admin_password)
        assert again.returncode == 0, again.stderr
        assert "already formed" in again.stdout
        # every node back at a new address (pods rescheduled): create meets them again
        cluster.move_all()
        nodes[:] = [f"{a.host}:{a.port}@{a.bus_port}" for a in cluster.addresses]
        with cluster.client(0) as c:
            view = str(c.execute_command("CLUSTER", "NODES"))  # type: ignore[no-untyped-call]
        known = {int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in view.splitlines()}
        assert not known & {a.port for a in cluster.addresses[1:]}  # only the old addresses
        healed = create(cluster.acl.admin_password)
        assert healed.returncode == 0, healed.stderr
        assert "already formed, every node met" in healed.stdout
        assert cluster.healthy()
        assert [a.primary for a in cluster.addresses] == [None, None, 0, 1]
