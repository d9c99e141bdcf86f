"""Policy and settings validation."""

from __future__ import annotations

import pytest

from common.config import load_config
from ratelimit.config import LimitPolicy, RateLimitConfig, Tenant


def test_capacity_defaults_to_one_minute() -> None:
    p = LimitPolicy(requests_per_minute=60, tokens_per_minute=1000, token_burst=50)
    assert p.request_capacity == 60
    assert p.token_capacity == 50
    assert not p.unlimited
    assert LimitPolicy().unlimited


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"requests_per_minute": -1}, "between 0 and 2"),
        ({"tokens_per_minute": 2**60}, "between 0 and 2"),
        ({"request_burst": 5}, "request_burst is set but requests_per_minute is 0"),
        ({"token_burst": 5}, "token_burst is set but tokens_per_minute is 0"),
        ({"max_concurrent": 1.5}, "must be an integer"),
    ],
)
def test_invalid_policies_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LimitPolicy(**kwargs)  # type: ignore[arg-type]


def test_divided_keeps_limits_limited() -> None:
    p = LimitPolicy(requests_per_minute=10, tokens_per_minute=1000, max_concurrent=3)
    share = p.divided(4)
    assert share == LimitPolicy(requests_per_minute=2, tokens_per_minute=250, max_concurrent=1)
    assert LimitPolicy().divided(4) == LimitPolicy()
    assert p.divided(1) is p


@pytest.mark.parametrize("bad", ["", "a{b}", "a:b", "-x", "x" * 65, "a b"])
def test_tenant_ids_are_hash_tag_safe(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant id"):
        Tenant(bad)


def test_allowed_models() -> None:
    assert Tenant("t").allows_model("any")
    t = Tenant("t", allowed_models=("m1",))
    assert t.allows_model("m1")
    assert not t.allows_model("m2")


def test_config_env_overrides_and_validation(tmp_path: object) -> None:
    env = {"LLM_RATELIMIT_FAIL_MODE": "closed", "LLM_RATELIMIT_TIMEOUT_MS": "25"}
    cfg = load_config(RateLimitConfig, "ratelimit", env=env)
    assert cfg.fail_mode == "closed"
    assert cfg.timeout_ms == 25
    with pytest.raises(ValueError, match="fail_mode must be one of"):
        load_config(RateLimitConfig, "ratelimit", env={"LLM_RATELIMIT_FAIL_MODE": "maybe"})
    with pytest.raises(ValueError, match="timeout_ms must be > 0"):
        RateLimitConfig(timeout_ms=0)
