"""Token-bucket math: pure functions of (policy, state, now), no I/O, no clock.

The Lua script in ``ratelimit/limiter/lua.py`` is a statement-for-statement port of
``decide`` and ``refund``, so the in-memory store (tests, fail-open fallback)
and Redis give the same answers for the same clock readings; the integration
tests check that with hypothesis.

One bucket (capacity ``C`` = burst or one minute's worth, rate ``p``/minute)::

    level
      C ┤━━━━┓             ┏━━━━━━   refill: min(C, level + elapsed_ms * p / 60000)
        │    ┗━┓       ┏━━━┛
        │      ┗━━┓ ┏━━┛             take:   level -= cost, only if EVERY dimension
      0 ┤         ┗━┛                        (requests, tokens, leases) has enough
        └──────────────────────► time

Because refill is continuous there are no window edges: over any interval of
``T`` ms at most ``C + p * T / 60000`` units are admitted (no 2x burst at
minute boundaries, unlike a fixed window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratelimit.config import Dimension, LimitPolicy

MS_PER_MINUTE = 60_000.0
UNLIMITED = -1.0  # level reported for a dimension without a limit
# Admission tolerance in units (tokens/requests). Units are integers, so this
# only absorbs float rounding; retry-after is computed against the same slack.
EPSILON = 1e-6


@dataclass(frozen=True, slots=True)
class BucketState:
    """Stored levels of a tenant's two buckets; ``None`` = full (or never used)."""

    requests: float | None
    tokens: float | None
    updated_ms: float


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one admission check decided.

    Attributes:
        allowed: The request may proceed (always true in shadow mode).
        denied: Dimensions that were short, also when shadow mode admitted anyway.
        retry_after_ms: Earliest time the same request could pass; 0 when
            nothing was short, -1 when it can never pass (cost > capacity).
        requests_left: Request-bucket level after the decision (-1 = unlimited).
        tokens_left: Token-bucket level after the decision (-1 = unlimited).
        num_leases: Live leases after the decision.
        now_ms: The clock reading the decision used (Redis TIME for Redis).
    """

    allowed: bool
    denied: Dimension
    retry_after_ms: int
    requests_left: float
    tokens_left: float
    num_leases: int
    now_ms: float

    @property
    def taken(self) -> bool:
        """True when the cost was taken from the buckets and a lease was added."""
        return self.allowed and self.denied == Dimension.NONE

    @property
    def shadow_denied(self) -> bool:
        """True when shadow mode admitted a request the limits would have denied."""
        return self.allowed and self.denied != Dimension.NONE


def refill(level: float | None, capacity: int, per_minute: int, elapsed_ms: float) -> float:
    """Level after ``elapsed_ms`` of refill; ``math.inf`` when ``per_minute`` is 0.

    Unlimited is infinity, not a sentinel level: a real level can go negative
    (an overrun charged at settle) and must never read as "no limit".
    A negative ``elapsed_ms`` (the clock stepped back) credits nothing.
    """
    if per_minute == 0:
        return math.inf
    if level is None:
        return float(capacity)
    if elapsed_ms < 0:
        elapsed_ms = 0.0
    return min(float(capacity), level + elapsed_ms * per_minute / MS_PER_MINUTE)


def reported(level: float) -> float:
    """A level as callers see it: ``UNLIMITED`` (-1) for no limit, else never below 0."""
    return UNLIMITED if math.isinf(level) else max(0.0, level)


def _stored(level: float) -> float | None:
    return None if math.isinf(level) else level


def _stamp(state: BucketState | None, now_ms: float) -> float:
    """The time a new state is stamped with: never earlier than the stored one, so a
    clock that steps back and forward again cannot credit the same interval twice."""
    return now_ms if state is None else max(state.updated_ms, now_ms)


def levels_at(policy: LimitPolicy, state: BucketState | None, now_ms: float) -> tuple[float, float]:
    """Current (requests, tokens) levels of ``state`` refilled up to ``now_ms``
    (``math.inf`` for a dimension without a limit)."""
    if state is None:
        state = BucketState(None, None, now_ms)
    elapsed = now_ms - state.updated_ms
    return (
        refill(state.requests, policy.request_capacity, policy.requests_per_minute, elapsed),
        refill(state.tokens, policy.token_capacity, policy.tokens_per_minute, elapsed),
    )


def wait_ms(deficit: float, per_minute: int) -> int:
    """Milliseconds until a bucket short by ``deficit`` units has refilled enough."""
    return max(1, math.ceil((deficit - EPSILON) * MS_PER_MINUTE / per_minute))


def tokens_wait(policy: LimitPolicy, level: float, num_tokens: int) -> int:
    """Whether a token bucket at ``level`` holds ``num_tokens``: 0 when it does, -1 when
    it never can (more than its capacity), else the milliseconds until it does."""
    if policy.tokens_per_minute and num_tokens > policy.token_capacity:
        return -1
    if level < num_tokens - EPSILON:
        return wait_ms(num_tokens - level, policy.tokens_per_minute)
    return 0


def decide(
    policy: LimitPolicy,
    state: BucketState | None,
    now_ms: float,
    *,
    num_tokens: int,
    num_leases: int,
    first_lease_expiry_ms: float | None,
    shadow: bool,
    concurrency_retry_ms: int,
) -> tuple[Outcome, BucketState | None]:
    """Check one request (1 request, ``num_tokens`` tokens, 1 lease) against every limit.

    Args:
        policy: The tenant's limits.
        state: Stored bucket levels, or None for a fresh (full) bucket.
        now_ms: Clock reading in milliseconds.
        num_tokens: Tokens to reserve (prompt + max new tokens).
        num_leases: Live (unexpired) leases of the tenant before this request.
        first_lease_expiry_ms: Earliest expiry among those leases.
        shadow: Admit even when short (the denial is still reported).
        concurrency_retry_ms: Upper bound of the retry hint for a full lease set.

    Returns:
        The outcome and the state to store (unchanged unless the cost was taken).
    """
    req, tok = levels_at(policy, state, now_ms)
    denied = Dimension.NONE
    wait = 0
    never = False
    if req < 1 - EPSILON:
        denied |= Dimension.REQUESTS
        wait = max(wait, wait_ms(1 - req, policy.requests_per_minute))
    token_wait = tokens_wait(policy, tok, num_tokens)
    if token_wait:
        denied |= Dimension.TOKENS
        never = token_wait < 0
        wait = max(wait, token_wait)
    if policy.max_concurrent and num_leases >= policy.max_concurrent:
        denied |= Dimension.CONCURRENCY
        hint = concurrency_retry_ms
        if first_lease_expiry_ms is not None:
            hint = min(hint, max(1, math.ceil(first_lease_expiry_ms - now_ms)))
        wait = max(wait, hint)
    if denied == Dimension.NONE:
        req, tok = req - 1, tok - num_tokens  # infinity stays infinity
        new_state: BucketState | None = BucketState(
            _stored(req), _stored(tok), _stamp(state, now_ms)
        )
        num_leases += 1
    else:
        new_state = state
    outcome = Outcome(
        allowed=denied == Dimension.NONE or shadow,
        denied=denied,
        retry_after_ms=-1 if never else wait,
        requests_left=reported(req),
        tokens_left=reported(tok),
        num_leases=num_leases,
        now_ms=now_ms,
    )
    return outcome, new_state


def take(
    policy: LimitPolicy,
    state: BucketState | None,
    now_ms: float,
    *,
    num_tokens: int,
    num_leases: int,
    shadow: bool,
) -> tuple[Outcome, BucketState | None]:
    """Check and take ``num_tokens`` tokens for a request already admitted by
    ``decide`` (its request unit and lease are taken; only tokens are checked).

    The gateway admits a request (``decide`` with 0 tokens) before tokenizing it, so
    a caller over its request rate never costs a tokenizer call, then takes the
    prompt + output budget here once the prompt's length is known.

    Returns:
        The outcome (``denied`` is TOKENS or NONE; ``num_leases`` as given) and the
        state to store (unchanged unless the tokens were taken).
    """
    req, tok = levels_at(policy, state, now_ms)
    wait = tokens_wait(policy, tok, num_tokens)
    denied = Dimension.TOKENS if wait else Dimension.NONE
    new_state = state
    if denied == Dimension.NONE and num_tokens:
        tok -= num_tokens
        new_state = BucketState(_stored(req), _stored(tok), _stamp(state, now_ms))
    outcome = Outcome(
        allowed=denied == Dimension.NONE or shadow,
        denied=denied,
        retry_after_ms=wait,
        requests_left=reported(req),
        tokens_left=reported(tok),
        num_leases=num_leases,
        now_ms=now_ms,
    )
    return outcome, new_state


def refund(
    policy: LimitPolicy, state: BucketState | None, now_ms: float, num_tokens: int
) -> BucketState | None:
    """Give ``num_tokens`` back to the token bucket, never above its capacity.

    A negative ``num_tokens`` charges an overrun (the bucket may go below 0,
    which delays the tenant's next request by exactly the overrun).
    """
    if num_tokens == 0 or policy.tokens_per_minute == 0:
        return state
    req, tok = levels_at(policy, state, now_ms)
    tok = min(float(policy.token_capacity), tok + num_tokens)
    return BucketState(_stored(req), tok, _stamp(state, now_ms))
