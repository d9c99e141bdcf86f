"""Tenant records in Redis: budgets survive the JSON round trip; older records load."""

from __future__ import annotations

import json

import pytest

from llm.v1 import admin_pb2
from ratelimit.admin.convert import tenant_from_proto, tenant_to_proto
from ratelimit.budget.policy import Budget, Metric, Period
from ratelimit.config import Tenant
from ratelimit.tenancy.records import (
    ApiKey,
    KeyRole,
    key_from_json,
    key_to_json,
    tenant_from_json,
    tenant_to_json,
)


def test_budgets_round_trip() -> None:
    t = Tenant(
        "acme",
        budgets=(
            Budget("daily", Metric.TOKENS, Period.DAY, 1000, timezone="Asia/Tokyo"),
            Budget("usd", Metric.COST, Period.MONTH, 2.5, rolling=True, warn_percent=0),
        ),
    )
    assert tenant_from_json(tenant_to_json(t)) == t


def test_a_record_written_before_budgets_loads_without_any() -> None:
    raw = json.loads(tenant_to_json(Tenant("old")))
    del raw["budgets"]
    assert tenant_from_json(json.dumps(raw)).budgets == ()


def test_too_many_budgets_are_refused() -> None:
    many = tuple(Budget(f"b{i}", Metric.TOKENS, Period.DAY, 10) for i in range(9))
    with pytest.raises(ValueError, match="at most 8"):
        Tenant("t", budgets=many)


def test_a_keys_budgets_round_trip_as_its_own() -> None:
    key = ApiKey(
        "key_1",
        "acme",
        "batch",
        "sk-llm-abcd",
        KeyRole.TENANT,
        "0" * 64,
        budgets=(Budget("daily", Metric.TOKENS, Period.DAY, 100, owner="key_1"),),
    )
    back = key_from_json(key_to_json(key))
    assert back == key
    assert back.budgets[0].label == "key_1/daily"


def test_fair_share_round_trips_and_old_records_get_one() -> None:
    t = Tenant("shared", fair_share=4)
    assert tenant_from_json(tenant_to_json(t)) == t
    raw = json.loads(tenant_to_json(Tenant("old")))
    del raw["fair_share"]
    assert tenant_from_json(json.dumps(raw)).fair_share == 1


@pytest.mark.parametrize("share", [0, 101, -1])
def test_a_fair_share_out_of_range_is_refused(share: int) -> None:
    with pytest.raises(ValueError, match="fair_share must be 1-100"):
        Tenant("t", fair_share=share)


def test_fair_share_over_the_admin_api() -> None:
    assert tenant_from_proto(admin_pb2.Tenant(id="t")).fair_share == 1  # 0 = 1
    shared = tenant_from_proto(admin_pb2.Tenant(id="t", fair_share=5))
    assert tenant_to_proto(shared).fair_share == 5


def test_prefix_cache_group_round_trips_and_sets_the_cache_salt() -> None:
    grouped = Tenant("a", prefix_cache_group="team-x")
    assert tenant_from_json(tenant_to_json(grouped)) == grouped
    assert tenant_to_proto(grouped).prefix_cache_group == "team-x"
    assert tenant_from_proto(admin_pb2.Tenant(id="a", prefix_cache_group="team-x")) == grouped
    raw = json.loads(tenant_to_json(Tenant("old")))
    del raw["prefix_cache_group"]  # records from before groups: the tenant's own cache
    assert tenant_from_json(json.dumps(raw)).prefix_cache_group == ""
    # the same group shares a salt; a tenant alone never shares one with another tenant
    assert grouped.cache_salt == Tenant("b", prefix_cache_group="team-x").cache_salt
    assert Tenant("a").cache_salt != Tenant("b").cache_salt
    assert Tenant("a").cache_salt != grouped.cache_salt
    # a tenant id equal to a group name still gets a salt of its own
    assert Tenant("team-x").cache_salt != grouped.cache_salt


@pytest.mark.parametrize("group", ["a:b", "{x}", "x" * 65, "-lead"])
def test_a_bad_prefix_cache_group_is_refused_naming_it(group: str) -> None:
    with pytest.raises(ValueError, match="prefix_cache_group"):
        Tenant("t", prefix_cache_group=group)
