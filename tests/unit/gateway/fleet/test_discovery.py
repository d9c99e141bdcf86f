"""Engine discovery: DNS names expand to one replica per address, re-resolved."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from common.breaker import BreakerPolicy
from gateway.fleet.discovery import Discovery, expand, has_names, resolve
from gateway.fleet.replica_pool import ReplicaPool

POLICY = BreakerPolicy(
    window_s=10,
    min_calls=4,
    error_ratio=0.5,
    consecutive_failures=3,
    open_s=1.0,
    max_open_s=8.0,
    half_open_probes=1,
)


class FakeDns:
    """A resolver whose answer the test changes (pods come and go)."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.answers:
            raise OSError(f"{host}: name not known")
        return [f"{ip}:{port}" for ip in self.answers[host]]


async def test_expand_keeps_ips_and_expands_names() -> None:
    dns = FakeDns({"engine": ["10.0.0.2", "10.0.0.1"]})
    got = await expand(["127.0.0.1:50071", "engine:50071", "missing:1", "127.0.0.1:50071"], dns)
    assert [str(e) for e in got] == ["127.0.0.1:50071", "10.0.0.2:50071", "10.0.0.1:50071"]
    assert [e.tls_name for e in got] == ["127.0.0.1", "engine", "engine"]
    assert has_names(["engine:1"])
    assert not has_names(["127.0.0.1:1", "[::1]:2"])


async def test_an_entry_keeps_its_protocol_and_options_on_each_address() -> None:
    dns = FakeDns({"vllm-pods": ["10.0.0.1", "10.0.0.2"]})
    got = await expand(["vllm://vllm-pods:8000?version=v2", "trtllm://10.0.0.9:9"], dns)
    assert [str(e) for e in got] == [
        "vllm://10.0.0.1:8000?version=v2",
        "vllm://10.0.0.2:8000?version=v2",
        "trtllm://10.0.0.9:9",
    ]
    assert has_names(["vllm://vllm-pods:1"])
    assert not has_names(["trtllm://10.0.0.9:9"])


async def test_localhost_is_one_replica() -> None:
    assert await resolve("localhost", 50071) == ["127.0.0.1:50071"]


async def test_pods_joining_and_leaving_change_the_pool() -> None:
    dns = FakeDns({"engine": ["10.0.0.1", "10.0.0.2"]})
    pool = ReplicaPool(["engine:50071"], POLICY)
    pool.retire_grace_s = 0.0
    disc = Discovery(["engine:50071"], pool.sync, interval_s=3600, resolver=dns)
    await disc.refresh()
    assert sorted(r.address for r in pool.replicas) == ["10.0.0.1:50071", "10.0.0.2:50071"]
    assert set(pool.breakers.breakers) == {"10.0.0.1:50071", "10.0.0.2:50071"}
    kept = next(r for r in pool.replicas if r.address == "10.0.0.1:50071")

    dns.answers["engine"] = ["10.0.0.1", "10.0.0.3"]  # one pod replaced
    await disc.refresh()
    assert sorted(r.address for r in pool.replicas) == ["10.0.0.1:50071", "10.0.0.3:50071"]
    assert kept in pool.replicas  # untouched replicas keep their state (breaker, stats)
    assert "10.0.0.2:50071" not in pool.breakers.breakers

    dns.answers.pop("engine")  # DNS hiccup: keep what we have
    assert await disc.refresh() == []
    assert len(pool.replicas) == 2
    for _ in range(5):
        await asyncio.sleep(0)  # let the retired replica close
    # the replica that left has no series any more (no alert on a replica that is gone)
    series = {
        s.labels.get("replica")
        for m in REGISTRY.collect()
        if m.name in ("gateway_replica_healthy", "gateway_breaker_state")
        for s in m.samples
    }
    assert "10.0.0.2:50071" not in series
    assert {"10.0.0.1:50071", "10.0.0.3:50071"} <= series
    await pool.close()


@pytest.mark.parametrize("entries", [["127.0.0.1:1"], ["10.1.2.3:50071", "10.1.2.4:50071"]])
async def test_only_names_start_a_resolver_loop(entries: list[str]) -> None:
    disc = Discovery(entries, lambda a: None, interval_s=3600)
    disc.start()
    assert disc._task is None
    await disc.close()
