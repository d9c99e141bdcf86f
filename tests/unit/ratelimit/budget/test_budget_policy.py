"""Budget periods: calendar boundaries in a time zone, rolling slots, prices."""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratelimit.budget.policy import (
    Budget,
    Metric,
    Period,
    Price,
    PriceTable,
    calendar_period,
    charge_of,
)

ZONES = ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe"]
# 2000-01-01 .. 2040-01-01
INSTANTS = st.integers(min_value=946_684_800_000, max_value=2_208_988_800_000)


def ms(dt: datetime) -> int:
    return int(dt.timestamp() * 1000)


def test_calendar_day_is_local_midnight_to_midnight() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    now = ms(datetime(2026, 12, 1, 23, 30, tzinfo=UTC))  # 00:30 on Dec 2 in Berlin
    start, end = calendar_period(Period.DAY, berlin, now)
    assert start == ms(datetime(2026, 12, 2, tzinfo=berlin))
    assert end == ms(datetime(2026, 12, 3, tzinfo=berlin))


def test_dst_days_are_23_and_25_hours() -> None:
    berlin = ZoneInfo("Europe/Berlin")
    spring = ms(datetime(2026, 3, 29, 12, tzinfo=berlin))
    autumn = ms(datetime(2026, 10, 25, 12, tzinfo=berlin))
    s, e = calendar_period(Period.DAY, berlin, spring)
    assert e - s == 23 * 3_600_000
    s, e = calendar_period(Period.DAY, berlin, autumn)
    assert e - s == 25 * 3_600_000


def test_month_starts_on_the_first_and_february_is_short() -> None:
    ny = ZoneInfo("America/New_York")
    s, e = calendar_period(Period.MONTH, ny, ms(datetime(2028, 2, 15, tzinfo=ny)))
    assert s == ms(datetime(2028, 2, 1, tzinfo=ny))
    assert e == ms(datetime(2028, 3, 1, tzinfo=ny))
    s, e = calendar_period(Period.MONTH, ny, ms(datetime(2026, 12, 31, 23, 59, tzinfo=ny)))
    assert e == ms(datetime(2027, 1, 1, tzinfo=ny))


@settings(max_examples=300, deadline=None)
@given(now=INSTANTS, zone_name=st.sampled_from(ZONES), period=st.sampled_from(list(Period)))
def test_calendar_period_contains_now_and_tiles_time(
    now: int, zone_name: str, period: Period
) -> None:
    tz = ZoneInfo(zone_name)
    start, end = calendar_period(period, tz, now)
    assert start <= now < end
    # the next period starts exactly where this one ends (no gap, no overlap)
    assert calendar_period(period, tz, end)[0] == end
    assert calendar_period(period, tz, start)[0] == start
    longest = {Period.HOUR: 1, Period.DAY: 25, Period.MONTH: 31 * 24 + 1}[period]
    assert end - start <= longest * 3_600_000
    if period != Period.HOUR:
        local = datetime.fromtimestamp(start / 1000, tz)
        assert (local.hour, local.minute) == (0, 0) or zone_name == "Australia/Lord_Howe"
        if period == Period.MONTH:
            assert local.day == 1


@settings(max_examples=200, deadline=None)
@given(now=INSTANTS, period=st.sampled_from(list(Period)))
def test_rolling_window_counts_at_least_one_whole_period(now: int, period: Period) -> None:
    b = Budget("r", Metric.TOKENS, period, 100, rolling=True)
    w = b.window(now)
    length = {Period.HOUR: 3_600_000, Period.DAY: 86_400_000, Period.MONTH: 30 * 86_400_000}
    assert w.slot <= now < w.slot + w.slot_ms
    # every instant of the last period lies in a slot that still counts ...
    assert w.oldest <= now - length[period]
    # ... and nothing older than one period plus one slot does
    assert w.oldest > now - length[period] - w.slot_ms
    assert w.resets_at_ms - w.slot == (w.span + 1) * w.slot_ms


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "Bad Name"}, "invalid budget name"),
        ({"limit": 0}, "limit must be > 0"),
        ({"limit": 10.5}, "whole number"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"warn_percent": 100}, "warn_percent"),
    ],
)
def test_invalid_budgets_say_what_is_wrong(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"name": "daily", "metric": 1, "period": 2, "limit": 1000}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Budget(**fields)  # type: ignore[arg-type]


def test_cost_budget_charges_by_price_and_tokens_budget_by_count() -> None:
    table = PriceTable.parse(
        {"m": {"prompt_per_million": 1.0, "completion_per_million": 4.0}, "*": {}}
    )
    price = table.price("m")
    cost = Budget("usd", Metric.COST, Period.MONTH, 5.0)
    tokens = Budget("tok", Metric.TOKENS, Period.DAY, 1000)
    assert charge_of(cost, price, 1_000_000, 500_000) == pytest.approx(3.0)
    assert charge_of(tokens, price, 10, 5) == 15
    assert table.price("other") == Price()
    with pytest.raises(ValueError, match="unknown keys"):
        PriceTable.parse({"m": {"prompt": 1}})


def test_describe_names_the_window() -> None:
    b = Budget("d", Metric.TOKENS, Period.DAY, 5000, timezone="Europe/Berlin")
    assert b.describe() == "5000 tokens per calendar day (Europe/Berlin)"
    r = Budget("h", Metric.COST, Period.HOUR, 2.5, rolling=True)
    assert r.describe() == "2.5 USD per rolling 60 minutes"


def test_lord_howes_half_hour_dst_shift_tiles_hours() -> None:
    # 2009-04-05 02:00 +11:00 -> 01:30 +10:30: a whole hour from 14:00Z would end at
    # 15:00Z, inside the repeated half hour, where the next period started at 14:00Z
    tz = ZoneInfo("Australia/Lord_Howe")
    first = calendar_period(Period.HOUR, tz, 1_238_853_600_000)  # 14:00Z
    second = calendar_period(Period.HOUR, tz, first[1])
    assert first == (1_238_853_600_000, 1_238_857_200_000)
    assert second[0] == first[1]
    assert calendar_period(Period.HOUR, tz, second[1])[0] == second[1]
