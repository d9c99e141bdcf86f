"""The Redis ACL of the stack: one service user, no anonymous access.

Redis holds API-key hashes, tenants and every bucket, so it accepts nobody but
the gateway (and the standalone admin service): the ``default`` user is off,
and the service user may touch only keys under the configured prefix, with
the commands the rate limiter and the registry use (reads, writes, Lua) and
nothing flagged dangerous or administrative (FLUSHALL, CONFIG, KEYS, DEBUG,
ACL, MONITOR, SHUTDOWN, ...).

``acl_file`` renders the server's ``--aclfile`` (the password stored as its
SHA-256, never in clear); ``make run``'s Redis uses it, and deploy/ renders the
same rules from a mounted secret (a test keeps the two in step).
"""

from __future__ import annotations

import hashlib
import re

from common.service_auth import check_secret

SERVICE_USER = "llm"
_USER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def service_rules(key_prefix: str) -> str:
    """The service user's permissions (everything after ``user <name> on <password>``)."""
    if not key_prefix or any(c in key_prefix for c in " *?[]\\"):
        raise ValueError(f"key prefix {key_prefix!r} cannot be used as an ACL key pattern")
    return (
        f"~{key_prefix}* resetchannels -@all "
        "+@read +@write +@keyspace +@scripting +@transaction +@connection "
        "+time -@dangerous -@admin -function -scan"
    )


def acl_file(password: str, key_prefix: str = "rl:", username: str = SERVICE_USER) -> str:
    """An ``--aclfile`` with ``default`` off and one service user.

    Raises:
        ValueError: a password ``check_secret`` refuses, or a user name Redis would
            misread.
    """
    check_secret(password, "the Redis password")
    if not _USER_RE.match(username) or username == "default":
        raise ValueError(f"bad Redis user name {username!r}")
    digest = hashlib.sha256(password.encode()).hexdigest()
    return (
        "user default off resetkeys -@all\n"
        f"user {username} on #{digest} {service_rules(key_prefix)}\n"
    )
