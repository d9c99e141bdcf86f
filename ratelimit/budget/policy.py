"""Spending budgets: what a tenant may use per hour, day or month, and when it resets.

A budget caps the tokens (``prompt + completion``) or the cost (USD, from a
per-model ``PriceTable``) a tenant spends in a period. Two kinds of window:

* ``calendar``: the clock hour, day or month in the budget's time zone (a day
  is midnight to midnight there, 23 or 25 hours across a DST change; a month
  starts on the 1st). Everything resets at the period's end.
* ``rolling``: the last hour, 24 hours or 30 days. Spending is counted in
  slots (1 minute, 1 hour, 1 day); a charge stops counting between one period
  and one period plus one slot after it was made, so any window of one period
  never holds more than the limit (conservative by at most one slot).

This module is pure arithmetic over unix time (no storage, no clock): the
ledger (``ratelimit.budget.ledger``) asks it for the slot to charge and the
oldest slot still counting.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

BUDGET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
MAX_BUDGET = 2**53  # levels are doubles in Lua; integers up to 2**53 stay exact
MAX_BUDGETS = 8  # per tenant: each is one more key in the admission script


class Metric(enum.IntEnum):
    """What a budget counts; values match ``llm.v1.BudgetMetric``."""

    TOKENS = 1  # prompt + completion tokens
    COST = 2  # USD, from the price table


class Period(enum.IntEnum):
    """Length of a budget period; values match ``llm.v1.BudgetPeriod``."""

    HOUR = 1
    DAY = 2
    MONTH = 3


_ROLLING_SLOTS_MS = {  # period -> (slot length, slots per period)
    Period.HOUR: (60_000, 60),
    Period.DAY: (3_600_000, 24),
    Period.MONTH: (86_400_000, 30),
}


@lru_cache(maxsize=64)
def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` (cached), or ValueError naming the problem."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"unknown time zone {name!r}: use an IANA name such as 'UTC' or 'Europe/Berlin'"
        ) from exc


@dataclass(frozen=True, slots=True)
class Window:
    """Where a charge made now goes, and what still counts.

    Attributes:
        slot: Id of the slot charged now (ms since the epoch of its start).
        oldest: Slots with an id below this no longer count (and are deleted).
        slot_ms: Length of one slot (0 for a calendar period: its slot is the period).
        resets_at_ms: Calendar: end of the period. Rolling: when the slot charged
            now stops counting.
        span: Slots per period for rolling windows (1 for calendar).
    """

    slot: int
    oldest: int
    slot_ms: int
    resets_at_ms: int
    span: int


@dataclass(frozen=True, slots=True)
class Budget:
    """One spending cap of a tenant.

    Attributes:
        name: Unique per tenant; shown in refusals and metrics (``[a-z0-9_-]``, 1-32).
        metric: Tokens or cost (USD).
        period: Hour, day or month.
        limit: The hard cap (tokens, or USD): a request that would pass it is refused.
        rolling: Rolling window instead of the calendar period.
        timezone: IANA zone of calendar periods (ignored for rolling windows).
        warn_percent: Soft threshold in percent of ``limit`` (0 = none): crossing it
            is logged, counted and reported in a response header; nothing is refused.
        owner: ``""`` for a tenant's budget, the key id for one of an API key's (set
            when the key is loaded, not stored with the budget).
    """

    name: str
    metric: Metric
    period: Period
    limit: float
    rolling: bool = False
    timezone: str = "UTC"
    warn_percent: int = 80
    owner: str = ""
    _zone: ZoneInfo = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not BUDGET_NAME_RE.match(self.name):
            raise ValueError(
                f"invalid budget name {self.name!r}: use 1-32 characters of lower-case "
                "letters, digits, '_' or '-', starting with a letter or digit"
            )
        object.__setattr__(self, "metric", Metric(self.metric))
        object.__setattr__(self, "period", Period(self.period))
        if not (isinstance(self.limit, int | float) and not isinstance(self.limit, bool)):
            raise ValueError(f"budget {self.name!r}: limit must be a number, got {self.limit!r}")
        if not (0 < self.limit <= MAX_BUDGET) or math.isnan(self.limit):
            raise ValueError(
                f"budget {self.name!r}: limit must be > 0 and <= 2**53, got {self.limit}"
            )
        if self.metric == Metric.TOKENS and self.limit != int(self.limit):
            raise ValueError(
                f"budget {self.name!r}: a token budget needs a whole number, got {self.limit}"
            )
        if not 0 <= self.warn_percent < 100:
            raise ValueError(
                f"budget {self.name!r}: warn_percent must be 0 (off) to 99, got {self.warn_percent}"
            )
        object.__setattr__(self, "_zone", zone(self.timezone or "UTC"))

    @property
    def label(self) -> str:
        """``name``, or ``<key id>/<name>`` for a key's budget (metrics, storage)."""
        return f"{self.owner}/{self.name}" if self.owner else self.name

    @property
    def unit(self) -> str:
        """``tokens`` or ``USD``."""
        return "tokens" if self.metric == Metric.TOKENS else "USD"

    def describe(self) -> str:
        """E.g. ``100000 tokens per calendar day (Europe/Berlin)``."""
        amount = _amount(self.limit, self.metric)
        period = self.period.name.lower()
        if self.rolling:
            span = {Period.HOUR: "60 minutes", Period.DAY: "24 hours", Period.MONTH: "30 days"}
            return f"{amount} per rolling {span[self.period]}"
        return f"{amount} per calendar {period} ({self.timezone})"

    def window(self, now_ms: float) -> Window:
        """The slot a charge at ``now_ms`` goes to and the oldest slot still counting."""
        if self.rolling:
            slot_ms, span = _ROLLING_SLOTS_MS[self.period]
            index = int(now_ms // slot_ms)
            # span + 1 slots count: a charge is forgotten only after a whole period
            oldest = (index - span) * slot_ms
            return Window(index * slot_ms, oldest, slot_ms, (index + span + 1) * slot_ms, span)
        start, end = calendar_period(self.period, self._zone, now_ms)
        return Window(start, start, 0, end, 1)


def validate_budgets(whose: str, budgets: tuple[Budget, ...]) -> None:
    """ValueError unless there are at most ``MAX_BUDGETS`` with unique names."""
    if len(budgets) > MAX_BUDGETS:
        raise ValueError(f"{whose} has {len(budgets)} budgets; at most {MAX_BUDGETS} are allowed")
    names = [b.name for b in budgets]
    if len(set(names)) != len(names):
        raise ValueError(f"{whose}: budget names must be unique: {names}")


def calendar_period(period: Period, tz: ZoneInfo, now_ms: float) -> tuple[int, int]:
    """(start, end) in ms of the calendar hour/day/month containing ``now_ms`` in ``tz``."""
    local = datetime.fromtimestamp(now_ms / 1000, tz)
    if period == Period.HOUR:
        return _local_hour(tz, now_ms)
    else:
        day = local.date().replace(day=1) if period == Period.MONTH else local.date()
        if period == Period.MONTH:
            following = (day + timedelta(days=32)).replace(day=1)
        else:
            following = day + timedelta(days=1)
        start_utc = _midnight(day, tz)
        end_utc = _midnight(following, tz)
    return int(start_utc.timestamp() * 1000), int(end_utc.timestamp() * 1000)


_QUARTER_MS = 15 * 60 * 1000  # every zone's offsets and changes fall on quarter hours


def _hour_boundary(tz: ZoneInfo, t_ms: int) -> bool:
    """True at a local hour's start: the wall clock reads :00, or the offset changes
    here (Lord Howe's 30-minute DST shift leaves a part-hour between two :00s)."""
    here = datetime.fromtimestamp(t_ms / 1000, tz)
    before = datetime.fromtimestamp((t_ms - _QUARTER_MS) / 1000, tz)
    return here.minute == 0 or here.utcoffset() != before.utcoffset()


def _local_hour(tz: ZoneInfo, now_ms: float) -> tuple[int, int]:
    """The local hour containing ``now_ms``: from the last boundary at or before it to
    the next one after it (at most an hour; a DST change can cut one short)."""
    start = int(now_ms // _QUARTER_MS) * _QUARTER_MS
    while not _hour_boundary(tz, start):
        start -= _QUARTER_MS
    end = start + _QUARTER_MS
    while not _hour_boundary(tz, end):
        end += _QUARTER_MS
    return start, end


def _midnight(day: date, tz: ZoneInfo) -> datetime:
    """The first instant of ``day`` in ``tz``, in UTC. Where a DST change skips local
    midnight, the zone's offset before the change maps it to the first valid instant."""
    return datetime(day.year, day.month, day.day, tzinfo=tz).astimezone(UTC)


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million prompt and completion tokens."""

    prompt_per_million: float = 0.0
    completion_per_million: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prompt_per_million", "completion_per_million"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or value < 0 or math.isnan(value):
                raise ValueError(f"price {name} must be a number >= 0, got {value!r}")

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """USD for that many tokens."""
        return (
            prompt_tokens * self.prompt_per_million
            + completion_tokens * self.completion_per_million
        ) / 1e6


@dataclass(frozen=True, slots=True)
class PriceTable:
    """Prices per model name; a model without one costs ``default``."""

    prices: dict[str, Price] = field(default_factory=dict)
    default: Price = Price()

    @classmethod
    def parse(cls, raw: dict[str, object]) -> PriceTable:
        """From config: ``{model: {prompt_per_million: x, completion_per_million: y}}``;
        the model name ``"*"`` sets the default."""
        prices: dict[str, Price] = {}
        for model, entry in raw.items():
            if not isinstance(entry, dict):
                raise ValueError(
                    f"price of model {model!r} must be a table with prompt_per_million and "
                    f"completion_per_million, got {entry!r}"
                )
            unknown = set(entry) - {"prompt_per_million", "completion_per_million"}
            if unknown:
                raise ValueError(f"price of model {model!r}: unknown keys {sorted(unknown)}")
            prices[str(model)] = Price(**entry)
        default = prices.pop("*", Price())
        return cls(prices, default)

    def price(self, model: str) -> Price:
        """The price of ``model``."""
        return self.prices.get(model, self.default)


def charge_of(budget: Budget, price: Price, prompt_tokens: int, completion_tokens: int) -> float:
    """What ``prompt_tokens + completion_tokens`` cost against ``budget``."""
    if budget.metric == Metric.TOKENS:
        return float(prompt_tokens + completion_tokens)
    return price.cost(prompt_tokens, completion_tokens)


def _amount(value: float, metric: Metric) -> str:
    if metric == Metric.TOKENS:
        return f"{int(value)} tokens"
    return f"{value:.6g} USD"


def amount_text(value: float, metric: Metric) -> str:
    """``1234 tokens`` or ``0.5 USD``."""
    return _amount(max(0.0, value), metric)
