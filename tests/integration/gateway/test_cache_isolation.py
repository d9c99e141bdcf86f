"""No cross-tenant prefix-cache oracle: the gateway salts every request's prefix cache
with its tenant (or the cache group an admin declared), so a tenant's cached-token
count reflects only its own (or its group's) earlier prompts.

One engine replica behind the gateway, so every request meets the same cache.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from common.procs import ManagedProcess
from common.redis_server import RedisServer
from llm.v1 import admin_pb2
from tests.integration.gateway.conftest import GatewayProcess, chat, start_gateway

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw_one_engine(
    engine_server: ManagedProcess,
    tokenizer_server: ManagedProcess,
    gw_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayProcess]:
    gw = start_gateway(
        "gw-cache-salt",
        [engine_server.address],
        tokenizer_server.address,
        gw_redis.url,
        tmp_path_factory.mktemp("gw-cache-salt"),
    )
    try:
        yield gw
    finally:
        gw.stop()


def cached_tokens(gw: GatewayProcess, key: str, text: str) -> int:
    chunks = gw.generate(key, chat(text, max_tokens=1))
    return int(chunks[-1].usage.cached_prompt_tokens)


def secret_prompt() -> str:
    """A prompt no earlier test sent, several KV blocks long."""
    words = " ".join(secrets.token_hex(3) for _ in range(60))
    return f"Internal memo {words}. Summarize it."


def grouped_tenant(gw: GatewayProcess, group: str) -> str:
    tid = f"t-{secrets.token_hex(4)}"
    gw.admin.UpsertTenant(admin_pb2.Tenant(id=tid, prefix_cache_group=group), metadata=gw.admin_md)
    return gw.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(tenant_id=tid, name="test"), metadata=gw.admin_md
    ).key


def test_another_tenant_gets_no_cached_tokens_from_a_tenants_prompt(
    gw_one_engine: GatewayProcess,
) -> None:
    gw = gw_one_engine
    _, key_a = gw.tenant()
    _, key_b = gw.tenant()
    prompt = secret_prompt()
    assert cached_tokens(gw, key_a, prompt) == 0
    assert cached_tokens(gw, key_a, prompt) > 32  # A still gets its own hits
    assert cached_tokens(gw, key_b, prompt) == 0  # B learns nothing of A's prompt
    assert cached_tokens(gw, key_b, prompt) > 32  # B's own second send hits


def test_tenants_of_one_declared_group_share_their_cache(gw_one_engine: GatewayProcess) -> None:
    gw = gw_one_engine
    group = f"g-{secrets.token_hex(3)}"
    key_a, key_b = grouped_tenant(gw, group), grouped_tenant(gw, group)
    _, outsider = gw.tenant()
    prompt = secret_prompt()
    assert cached_tokens(gw, key_a, prompt) == 0
    assert cached_tokens(gw, key_b, prompt) > 32
    assert cached_tokens(gw, outsider, prompt) == 0
