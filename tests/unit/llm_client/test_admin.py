"""llm-client's admin tenant: creates, or changes only the given settings."""

from __future__ import annotations

import argparse
import time
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from llm.v1 import admin_pb2, common_pb2
from llm_client.admin import _admin_calls, key_update
from llm_client.admin_args import duration_s
from llm_client.cli import parser


class NotFound(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.NOT_FOUND


class FakeAdmin:
    """The two RateLimitAdmin calls the command makes, over a dict."""

    def __init__(self) -> None:
        self.tenants: dict[str, admin_pb2.Tenant] = {}

    def GetTenant(self, req: admin_pb2.GetTenantRequest) -> admin_pb2.Tenant:
        if req.tenant_id not in self.tenants:
            raise NotFound()
        out = admin_pb2.Tenant()
        out.CopyFrom(self.tenants[req.tenant_id])
        return out

    def UpsertTenant(self, t: admin_pb2.Tenant) -> admin_pb2.Tenant:
        self.tenants[t.id] = t
        return t


def run(stub: Any, *argv: str) -> admin_pb2.Tenant:
    args = parser().parse_args(["admin", "tenant", *argv])
    out = _admin_calls(args)["tenant"](stub)
    assert isinstance(out, admin_pb2.Tenant)
    return out


def test_a_new_tenant_gets_the_flags_and_defaults() -> None:
    stub = FakeAdmin()
    t = run(stub, "team-a", "--rpm", "60", "--tpm", "50000", "--model", "m1")
    assert (t.limits.requests_per_minute, t.limits.tokens_per_minute) == (60, 50000)
    assert t.priority == common_pb2.Priority.Value("NORMAL")
    assert list(t.allowed_models) == ["m1"]
    assert not t.shadow_mode


def test_changing_one_setting_keeps_the_others() -> None:
    stub = FakeAdmin()
    run(stub, "team-a", "--rpm", "60", "--tpm", "50000", "--concurrent", "4", "--model", "m1")
    t = run(stub, "team-a", "--priority", "CRITICAL", "--share", "3")
    assert t.priority == common_pb2.Priority.Value("CRITICAL")
    assert t.fair_share == 3
    assert (t.limits.requests_per_minute, t.limits.tokens_per_minute) == (60, 50000)
    assert t.limits.max_concurrent == 4
    assert list(t.allowed_models) == ["m1"]
    t = run(stub, "team-a", "--shadow", "--rpm", "0")  # 0 = unlimited, said explicitly
    assert t.shadow_mode
    assert (t.limits.requests_per_minute, t.limits.tokens_per_minute) == (0, 50000)
    t = run(stub, "team-a", "--cache-group", "search")
    assert t.prefix_cache_group == "search"
    assert t.fair_share == 3
    t = run(stub, "team-a", "--cache-group", "")
    assert t.prefix_cache_group == ""
    t = run(stub, "team-a", "--no-shadow", "--all-models")
    assert not t.shadow_mode
    assert list(t.allowed_models) == []
    assert t.priority == common_pb2.Priority.Value("CRITICAL")


def test_budgets_are_added_replaced_by_name_and_dropped() -> None:
    stub = FakeAdmin()
    t = run(
        stub,
        "team-a",
        "--budget",
        "daily=200000/day,tz=Europe/Berlin",
        "--budget",
        "spend=25usd/month,warn=90",
    )
    daily, spend = t.budgets
    assert (daily.name, daily.limit, daily.timezone, daily.warn_percent) == (
        "daily",
        200000,
        "Europe/Berlin",
        80,
    )
    assert daily.period == admin_pb2.BudgetPeriod.Value("BUDGET_DAY")
    assert daily.metric == admin_pb2.BudgetMetric.Value("BUDGET_TOKENS")
    assert spend.metric == admin_pb2.BudgetMetric.Value("BUDGET_COST_USD")
    assert (spend.limit, spend.warn_percent, spend.rolling) == (25.0, 90, False)
    t = run(stub, "team-a", "--budget", "daily=5000/hour,rolling", "--rpm", "10")
    assert [b.name for b in t.budgets] == ["spend", "daily"]
    assert t.budgets[1].rolling
    assert t.budgets[1].period == admin_pb2.BudgetPeriod.Value("BUDGET_HOUR")
    t = run(stub, "team-a", "--drop-budget", "spend")
    assert [b.name for b in t.budgets] == ["daily"]
    assert t.limits.requests_per_minute == 10


def test_a_malformed_budget_is_refused_with_the_expected_form(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in ("daily", "daily=100/week", "daily=lots/day", "daily=1/day,sometimes"):
        with pytest.raises(SystemExit):
            parser().parse_args(["admin", "tenant", "t", "--budget", bad])
        assert "budget" in capsys.readouterr().err


def test_key_update_sends_only_the_given_fields_in_the_mask() -> None:
    args = parser().parse_args(["admin", "key-update", "key_1", "--owner", "bob", "--no-expiry"])
    req = key_update(args)
    assert req.api_key.key_id == "key_1"
    assert list(req.update_mask.paths) == ["owner", "expires_at"]
    assert req.api_key.owner == "bob"
    assert not req.api_key.HasField("expires_at")  # unset = never
    args = parser().parse_args(["admin", "key-update", "key_1", "--expires-in", "2h"])
    req = key_update(args)
    assert list(req.update_mask.paths) == ["expires_at"]
    assert abs(req.api_key.expires_at.seconds - (time.time() + 7200)) < 5
    with pytest.raises(SystemExit):
        key_update(parser().parse_args(["admin", "key-update", "key_1"]))


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200), ("30d", 2592000)]
)
def test_durations(text: str, seconds: int) -> None:
    assert duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5m", "1w", "h"])
def test_bad_durations_say_the_form(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a duration"):
        duration_s(text)


def test_key_update_replaces_or_drops_the_keys_budgets() -> None:
    args = parser().parse_args(
        ["admin", "key-update", "key_1", "--budget", "daily=1000/day", "--budget", "h=10/hour"]
    )
    req = key_update(args)
    assert list(req.update_mask.paths) == ["budgets"]
    assert [b.name for b in req.api_key.budgets] == ["daily", "h"]
    req = key_update(parser().parse_args(["admin", "key-update", "key_1", "--no-budgets"]))
    assert list(req.update_mask.paths) == ["budgets"]
    assert not req.api_key.budgets


def test_route_command_builds_targets_with_optional_versions() -> None:
    args = parser().parse_args(["admin", "route", "r", "big@v2", "small", "--reason", "why"])
    calls = _admin_calls(args)

    class Stub:
        def SetModelRoute(self, msg: admin_pb2.ModelRoute) -> admin_pb2.ModelRoute:
            return msg

    out = calls["route"](Stub())
    assert isinstance(out, admin_pb2.ModelRoute)
    assert [(t.model, t.version) for t in out.targets] == [("big", "v2"), ("small", "")]
    assert out.reason == "why"


def test_routes_and_route_delete_call_the_routing_admin() -> None:
    sent: list[Message] = []

    class Stub:
        def ListModelRoutes(self, msg: admin_pb2.ListModelRoutesRequest) -> Message:
            sent.append(msg)
            return msg

        def DeleteModelRoute(self, msg: admin_pb2.DeleteModelRouteRequest) -> Message:
            sent.append(msg)
            return msg

    _admin_calls(parser().parse_args(["admin", "routes"]))["routes"](Stub())
    args = parser().parse_args(["admin", "route-delete", "team-chat"])
    _admin_calls(args)["route-delete"](Stub())
    assert isinstance(sent[0], admin_pb2.ListModelRoutesRequest)
    assert sent[1] == admin_pb2.DeleteModelRouteRequest(name="team-chat")
