"""The Redis ACL of the stack: one service user, no anonymous access.

Redis holds API-key hashes, tenants and every bucket, so it accepts nobody but
the gateway (and the standalone admin service): the ``default`` user is off,
and the service user may touch only keys under the configured prefix, with
the commands the rate limiter and the registry use (reads, writes, Lua) and
nothing flagged dangerous or administrative (FLUSHALL, CONFIG, KEYS, DEBUG,
ACL, MONITOR, SHUTDOWN, ...), nor ``SCRIPT FLUSH`` / ``KILL`` (it loads and runs
scripts, it never needs to drop or stop them).

A Redis Cluster (the services' ``ratelimit.redis_cluster`` setting; local ones from
``common.redis_cluster``, formed by ``common.redis_cluster_formation``) runs the same
model on every node, with three differences (``ClusterAcl``):

- the service user may also read the slot map (``CLUSTER SLOTS``, ``CLUSTER
  SHARDS``: the cluster client asks a seed for it at start and after a
  ``MOVED`` or a failed node), and nothing else of ``CLUSTER``;
- a replication user (``masteruser`` / ``masterauth`` on every node, since any
  node may become a replica after a failover) may run only what a replica sends
  its primary (``PSYNC``, ``SYNC``, ``REPLCONF``, ``PING``), on no key and no channel;
- an operator user forms the cluster, fails it over and reads ``INFO``: every
  command, with its own password that no service holds.

``acl_file`` renders the server's ``--aclfile`` (passwords stored as their
SHA-256, never in clear); ``common.redis_server`` (``make run``'s Redis) and
``common.redis_cluster`` use it, and deploy/ renders the same rules from a mounted
secret (a test keeps them in step).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from common.service_auth import check_secret

SERVICE_USER = "llm"
REPLICATION_USER = "llm-replication"
ADMIN_USER = "llm-admin"
_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# what redis-py's cluster client reads besides the keys (the slot map); the rest of
# CLUSTER (MEET, FORGET, RESET, FAILOVER, SETSLOT, ...) stays the operator's
CLUSTER_TOPOLOGY_RULES = "+cluster|slots +cluster|shards"
# what a replica sends its primary: the handshake's PING and REPLCONF, then PSYNC (and
# SYNC, which Valkey's dual-channel replication sends on its RDB channel)
REPLICATION_RULES = "resetkeys resetchannels -@all +psync +sync +replconf +ping"
ADMIN_RULES = "~* &* +@all"


def service_rules(key_prefix: str, *, cluster: bool = False) -> str:
    """The service user's permissions (everything after ``user <name> on <password>``);
    with ``cluster``, plus reading the slot map."""
    if not key_prefix or any(c in key_prefix for c in " *?[]\\"):
        raise ValueError(f"key prefix {key_prefix!r} cannot be used as an ACL key pattern")
    rules = (
        f"~{key_prefix}* resetchannels -@all "
        "+@read +@write +@keyspace +@scripting +@transaction +@connection "
        "+time -@dangerous -@admin -function -scan -script|flush -script|kill"
    )
    return f"{rules} {CLUSTER_TOPOLOGY_RULES}" if cluster else rules


@dataclass(frozen=True, slots=True)
class ClusterAcl:
    """The two passwords a cluster node needs besides the service user's.

    Attributes:
        replication_password: The replication user's (``masterauth`` of every node).
        admin_password: The operator user's (cluster formation, failover, INFO).
    """

    replication_password: str
    admin_password: str

    def __post_init__(self) -> None:
        check_secret(self.replication_password, "the Redis replication password")
        check_secret(self.admin_password, "the Redis admin password")

    def server_config(self) -> str:
        """Lines for the node's config file: how it authenticates to its primary (a file,
        not the command line, so the password is not in the process list)."""
        return f"masteruser {REPLICATION_USER}\nmasterauth {self.replication_password}\n"


def _user(name: str, password: str, rules: str) -> str:
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user {name} on #{digest} {rules}\n"


def acl_file(
    password: str,
    key_prefix: str = "rl:",
    username: str = SERVICE_USER,
    *,
    cluster: ClusterAcl | None = None,
) -> str:
    """An ``--aclfile`` with ``default`` off and one service user (and with ``cluster``,
    the replication and operator users, the service user reading the slot map).

    Raises:
        ValueError: a password ``check_secret`` refuses, or a user name Redis would
            misread.
    """
    check_secret(password, "the Redis password")
    if (
        not _USER_RE.match(username)
        or username == "default"
        or (cluster is not None and username in (REPLICATION_USER, ADMIN_USER))
    ):
        raise ValueError(f"bad Redis user name {username!r}")
    text = "user default off resetkeys -@all\n" + _user(
        username, password, service_rules(key_prefix, cluster=cluster is not None)
    )
    if cluster is not None:
        text += _user(REPLICATION_USER, cluster.replication_password, REPLICATION_RULES)
        text += _user(ADMIN_USER, cluster.admin_password, ADMIN_RULES)
    return text
