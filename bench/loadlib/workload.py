"""Workload mixes and tenants, reproducible from one seed.

A *shape* draws (prompt tokens, output tokens) for one request; a *mix* is a
weighted set of shapes. Every tenant has its own random stream (seed + crc32
of its name), so adding a tenant never changes another tenant's requests.

    short_chat     prompt 24-96,    output 16-64      interactive chat turns
    long_context   prompt 900-1700, output 16-48      RAG / document questions
    long_output    prompt 24-64,    output 192-384    generation-heavy
    chatlike       lognormal: prompt median 120 (8-1500), output median 48 (4-384),
                   the skew of real chat traces (many short, a long tail)

Mixes are written ``short_chat`` or ``short_chat:0.8,long_context:0.2``.
Prompts are real text (words from a fixed list) sent as one user message:
token ids through the model's chat template for an engine, text for a gateway.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from tokenizer_svc.chat_template import Message
from tokenizer_svc.tokenizer import TextTokenizer

PRIORITIES = {"LOW": 1, "NORMAL": 2, "CRITICAL": 3}
_WORD_TEXT = (
    "the a of to and in is for on that with as by at from it this be are was not or have an "
    "model request token server engine cache block queue latency batch tenant gateway limit "
    "memory context prompt output stream decode prefill priority scheduler replica budget "
    "river mountain city garden window morning evening quiet bright simple careful steady "
    "explain describe compare summarize list write answer question reason example detail"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class Shape:
    """Distribution of prompt and output lengths (tokens)."""

    name: str
    prompt: tuple[int, int]
    output: tuple[int, int]
    lognormal: tuple[float, float] | None = None  # (prompt median, output median)

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """(prompt tokens, output tokens) for one request."""
        if self.lognormal is None:
            return rng.randint(*self.prompt), rng.randint(*self.output)
        p = int(rng.lognormvariate(math.log(self.lognormal[0]), 0.9))
        o = int(rng.lognormvariate(math.log(self.lognormal[1]), 0.8))
        return (
            min(max(p, self.prompt[0]), self.prompt[1]),
            min(max(o, self.output[0]), self.output[1]),
        )


SHAPES = {
    s.name: s
    for s in (
        Shape("short_chat", (24, 96), (16, 64)),
        Shape("long_context", (900, 1700), (16, 48)),
        Shape("long_output", (24, 64), (192, 384)),
        Shape("chatlike", (8, 1500), (4, 384), lognormal=(120.0, 48.0)),
    )
}


def parse_mix(text: str) -> list[tuple[Shape, float]]:
    """``"short_chat:0.8,long_context:0.2"`` -> [(shape, weight), ...].

    Raises:
        ValueError: an unknown shape or a non-positive weight.
    """
    out: list[tuple[Shape, float]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition(":")
        if name not in SHAPES:
            raise ValueError(f"unknown workload {name!r}; choose from {sorted(SHAPES)}")
        w = float(weight or 1.0)
        if w <= 0:
            raise ValueError(f"weight of {name!r} must be > 0, got {w}")
        out.append((SHAPES[name], w))
    if not out:
        raise ValueError("empty workload mix")
    return out


@dataclass(slots=True)
class TenantSpec:
    """One tenant of a run: who it is, how it is limited, what and how fast it sends.

    ``rate`` (req/s, Poisson) or ``concurrency`` (closed loop) give the tenant its
    own arrival process; otherwise it takes ``share`` of the run's global one.
    Limits (0 = unlimited) are applied through the admin API on gateway targets;
    ``key`` names an existing API key instead (then nothing is created).
    """

    name: str
    priority: str = "NORMAL"
    share: float = 1.0
    mix: str = ""
    rate: float = 0.0
    concurrency: int = 0
    rpm: int = 0
    tpm: int = 0
    max_concurrent: int = 0
    request_burst: int = 0
    key: str = field(default="", repr=False)

    @property
    def priority_value(self) -> int:
        """llm.v1.Priority number."""
        return PRIORITIES[self.priority]

    @classmethod
    def parse(cls, text: str) -> TenantSpec:
        """``name=chat,priority=CRITICAL,rate=2,mix=short_chat,rpm=600`` -> TenantSpec."""
        fields = dict(kv.split("=", 1) for kv in text.split(",") if kv)
        spec = cls(name=fields.pop("name", "bench"))
        for k, v in fields.items():
            if k not in cls.__dataclass_fields__:
                raise ValueError(f"unknown tenant field {k!r} in {text!r}")
            cur = getattr(spec, k)
            setattr(spec, k, type(cur)(v.upper() if k == "priority" else v))
        if spec.priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {list(PRIORITIES)}, got {spec.priority}")
        return spec


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the user text, its chat-template ids, and the output length."""

    index: int
    tenant: str
    priority: int
    kind: str
    text: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass(slots=True)
class Caps:
    """Clamps that make any mix fit a small engine or a seconds-long smoke run."""

    max_prompt_tokens: int = 0
    max_output_tokens: int = 0

    def apply(self, prompt: int, output: int) -> tuple[int, int]:
        """Clamp (prompt, output) to the caps (0 = no cap)."""
        if self.max_prompt_tokens:
            prompt = min(prompt, self.max_prompt_tokens)
        if self.max_output_tokens:
            output = min(output, self.max_output_tokens)
        return max(prompt, 4), max(output, 1)


class TextPool:
    """A few thousand tokens of word salad; prompts are slices of it."""

    def __init__(self, tok: TextTokenizer, seed: int, num_words: int = 6000) -> None:
        rng = random.Random(seed)
        self.tok = tok
        self.ids = tok.encode(
            " ".join(rng.choice(_WORDS) for _ in range(num_words)), add_special_tokens=False
        )

    def text(self, rng: random.Random, num_tokens: int) -> str:
        """Text of about ``num_tokens`` tokens."""
        n = min(num_tokens, len(self.ids) - 1)
        start = rng.randrange(0, len(self.ids) - n)
        return self.tok.decode(self.ids[start : start + n])


def tenant_requests(
    spec: TenantSpec, default_mix: str, pool: TextPool, seed: int, caps: Caps
) -> Iterator[RequestSpec]:
    """The endless, reproducible request stream of one tenant."""
    rng = random.Random(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    mix = parse_mix(spec.mix or default_mix)
    shapes, weights = [s for s, _ in mix], [w for _, w in mix]
    for i in range(1 << 62):
        shape = rng.choices(shapes, weights)[0]
        num_prompt, num_output = caps.apply(*shape.draw(rng))
        text = f"[{spec.name} #{i}] " + pool.text(rng, num_prompt)
        ids, _ = pool.tok.encode_chat([Message("user", text)])
        yield RequestSpec(i, spec.name, spec.priority_value, shape.name, text, ids, num_output)
