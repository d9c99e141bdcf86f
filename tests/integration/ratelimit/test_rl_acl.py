"""Redis with the stack's ACL: nobody anonymous, the service user only under its prefix.

Every Redis call the gateway makes (Lua reserve/settle/heartbeat/usage, the
registry, the audit log) runs here as the ACL user with ``fail_mode: closed``,
so a command or key the ACL forbids fails the test instead of falling back.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from common.redis_acl import SERVICE_USER, acl_file, service_rules
from common.redis_server import RedisServer
from ratelimit.config import LimitPolicy, RateLimitConfig, Tenant
from ratelimit.factory import RateLimitStack
from ratelimit.tenancy.records import KeyRole

pytestmark = pytest.mark.integration
PASSWORD = secrets.token_hex(32)
PREFIX = "acl:"


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    server = RedisServer(password=PASSWORD, key_prefix=PREFIX).start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
async def service_client(acl_server: RedisServer) -> AsyncIterator[Redis]:
    client = Redis.from_url(
        acl_server.url, username=SERVICE_USER, password=PASSWORD, decode_responses=True
    )
    try:
        yield client
    finally:
        await client.aclose()


async def test_anonymous_and_wrong_password_are_refused(acl_server: RedisServer) -> None:
    anonymous = Redis.from_url(acl_server.url)
    wrong = Redis.from_url(acl_server.url, username=SERVICE_USER, password="x" * 64)
    default = Redis.from_url(acl_server.url, username="default", password="")
    try:
        with pytest.raises((AuthenticationError, ResponseError), match=r"(?i)noauth|auth"):
            await anonymous.get(f"{PREFIX}x")
        with pytest.raises(AuthenticationError):
            await wrong.ping()
        with pytest.raises((AuthenticationError, ResponseError)):
            await default.get(f"{PREFIX}x")
    finally:
        for c in (anonymous, wrong, default):
            await c.aclose()


@pytest.mark.parametrize(
    "command",
    [
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("CONFIG", "GET", "*"),
        ("KEYS", "*"),
        ("CLIENT", "LIST"),
        ("SAVE",),
        ("ACL", "LIST"),
        ("MONITOR",),
        ("SHUTDOWN",),
        ("SCAN", "0"),
        ("INFO",),
        ("FUNCTION", "FLUSH"),
        ("SCRIPT", "FLUSH"),
        ("SCRIPT", "KILL"),
        ("SET", "other:key", "1"),
        ("GET", "rl:tenant"),
    ],
)
async def test_service_user_cannot_run_admin_commands_or_leave_its_prefix(
    service_client: Redis, command: tuple[str, ...]
) -> None:
    with pytest.raises(NoPermissionError):
        await service_client.execute_command(*command)  # type: ignore[no-untyped-call]
    assert await service_client.ping()  # the server is still up and the connection usable


async def test_lua_cannot_reach_outside_the_prefix(service_client: Redis) -> None:
    with pytest.raises(NoPermissionError):  # keys a script names are checked as well
        await service_client.eval("return redis.call('SET', KEYS[1], 1)", 1, "other:k")
    with pytest.raises(ResponseError, match=r"(?i)no permissions|noperm"):
        await service_client.eval("return redis.call('SET', 'other:k', 1)", 0)


async def test_the_whole_limiter_and_registry_work_as_the_service_user(
    acl_server: RedisServer, tmp_path: Path
) -> None:
    password_file = tmp_path / "redis.password"
    password_file.write_text(PASSWORD + "\n")
    config = RateLimitConfig(
        redis_url=acl_server.url,
        redis_username=SERVICE_USER,
        redis_password_file=str(password_file),
        key_prefix=PREFIX,
        fail_mode="closed",
        admin_key="sk-llm-" + "a" * 40,
    )
    stack = RateLimitStack.from_config(config)
    await stack.start(wait_s=10)  # loads every script, registers the admin key
    try:
        tenant = await stack.registry.upsert_tenant(
            Tenant(
                "acme",
                LimitPolicy(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=2),
            )
        )
        plaintext, _ = await stack.registry.create_key("acme", "ci", KeyRole.TENANT)
        principal = await stack.registry.authenticate(plaintext)
        assert principal.tenant is not None
        assert principal.tenant.tenant_id == "acme"
        decision = await stack.limiter.reserve(tenant, 100)
        assert decision.allowed
        assert decision.source == "redis"
        assert decision.reservation is not None
        assert await stack.limiter.heartbeat(decision.reservation)
        await stack.limiter.settle(decision.reservation, prompt_tokens=30, completion_tokens=20)
        usage = await stack.limiter.usage(tenant)
        assert usage.concurrent_in_use == 0  # the settle ran (a NOPERM would leave the lease)
        assert (usage.prompt_tokens_total, usage.completion_tokens_total) == (30, 20)
        await stack.audit.record("ci", "upsert_tenant", "acme", {})
        assert [e.action for e in await stack.audit.list()] == ["upsert_tenant"]
        assert await stack.registry.delete_tenant("acme") >= 1
    finally:
        await stack.aclose()


def test_acl_file_stores_only_a_hash_of_the_password() -> None:
    text = acl_file(PASSWORD, PREFIX)
    assert PASSWORD not in text
    assert "user default off" in text
    assert service_rules(PREFIX) in text
    with pytest.raises(ValueError, match="at least 32"):
        acl_file("short")
    with pytest.raises(ValueError, match="ACL key pattern"):
        service_rules("rl:* ~*")
