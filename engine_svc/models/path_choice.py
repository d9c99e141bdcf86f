"""The weight/compute dtype chosen at start by timing the batches the engine will run.

A choice timed at one row can be wrong at 32 (on AVX512-BF16 an fp32 GEMV wins at
one row while bf16 GEMMs are 3x faster at 32), and a choice timed on bare
``F.linear`` misses the paths each dtype really runs (the 4-bit GEMV, prepacked
weights, the compiled decode step, the bf16 KV cache). So each candidate dtype is
built as a small copy of the real model (its first few layers from the checkpoint,
its LM head, a paged KV cache in the dtype it would get), its linear paths are
tuned as the engine tunes them, and it runs the step kinds the scheduler makes:

    decode   ``max_num_seqs`` sequences, one new token each, mid-length contexts
    prefill  one chunk of ``max_num_batched_tokens`` prompt tokens
    single   one sequence decoding alone (latency of a lone request)

A candidate's score is the geometric mean of its step times (each step kind
counts alike, whatever its absolute size), its decoder time scaled from the
layers built to the model's; the lowest score wins. ``choose`` is the pure
decision over measured times (unit-tested with injected ones); ``measure``
takes the times.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine_svc.models import ops, timing
from engine_svc.models.attention import build_attention_metadata
from engine_svc.models.config import ModelConfig, load_model_config
from engine_svc.models.linear import LinearChoice, tune_linears
from engine_svc.models.llama import LlamaForCausalLM

BENCH_LAYERS = 4  # decoder layers built per candidate (the LM head is always built)
DECODE_CONTEXT = 256  # tokens already cached per decoding sequence
ROUNDS = 3  # timed rounds per step kind (best of them counts)
TUNE_ROUNDS = 2  # per path configuration when tuning a candidate's linears


@dataclass(frozen=True, slots=True)
class Workload:
    """One step kind: ``seqs`` sequences with ``new`` tokens each after ``context``."""

    name: str
    seqs: int
    new: int
    context: int


def workloads(max_num_seqs: int, prefill_chunk: int) -> list[Workload]:
    """The step kinds the scheduler makes with these limits (see the module doc)."""
    return [
        Workload("decode", max_num_seqs, 1, DECODE_CONTEXT),
        Workload("prefill", 1, prefill_chunk, 0),
        Workload("single", 1, 1, DECODE_CONTEXT),
    ]


@dataclass(slots=True)
class PathChoice:
    """The winner and why.

    Attributes:
        name: the chosen candidate (a dtype name).
        scores: candidate -> geometric mean of its step times (ms).
        timings_ms: candidate -> step kind -> ms of a whole-model step.
        paths: candidate -> its tuned linear paths (``LinearChoice.name``).
    """

    name: str
    scores: dict[str, float]
    timings_ms: dict[str, dict[str, float]]
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """``bfloat16+q4<=16: decode 12.1 ms, ... vs float32+skinny<=2: ...`` for logs."""

        def one(c: str) -> str:
            steps = ", ".join(f"{k} {v:.1f}" for k, v in self.timings_ms[c].items())
            return f"{self.paths.get(c, c)} [{steps} ms]"

        others = [c for c in self.scores if c != self.name]
        return one(self.name) + "".join(f" vs {one(c)}" for c in others)


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(max(v, 1e-9)) for v in values) / len(values))


def choose(timings_ms: Mapping[str, Mapping[str, float]]) -> PathChoice:
    """The candidate with the lowest geometric mean of its step times; on a tie the
    one listed first. Every candidate must have timed the same step kinds.

    Raises:
        ValueError: no candidates, or candidates timed on different step kinds.
    """
    if not timings_ms:
        raise ValueError("no candidates to choose from")
    kinds = {frozenset(t) for t in timings_ms.values()}
    if len(kinds) != 1 or not next(iter(kinds)):
        raise ValueError(f"candidates timed different step kinds: {dict(timings_ms)}")
    scores = {c: _geomean(list(t.values())) for c, t in timings_ms.items()}
    best = min(scores, key=lambda c: scores[c])  # min keeps the first of equals
    return PathChoice(best, scores, {c: dict(t) for c, t in timings_ms.items()})


def _load_layers(
    model_dir: str | Path, config: ModelConfig, layers: int
) -> dict[str, torch.Tensor]:
    """The checkpoint's first ``layers`` decoder layers, embeddings, norm and LM head, fp32."""
    layer_names = [f"model.layers.{i}." for i in range(layers)]
    wanted = ("model.embed_tokens.", "model.norm.", "lm_head.", *layer_names)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.startswith(wanted):
                    out[name] = sf.get_tensor(name).float()
    return out


@dataclass(slots=True)
class _Candidate:
    model: LlamaForCausalLM
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None  # an FP8 cache's (unit) scales
    choice: LinearChoice


def _build(
    config: ModelConfig, exact: dict[str, torch.Tensor], dtype: torch.dtype,
    kv_dtype: Callable[[torch.dtype], torch.dtype], q4_weights: bool, blocks: int, block_size: int,
) -> _Candidate:  # fmt: skip
    weights = {n: t.to(dtype) for n, t in exact.items()}
    use_q4 = q4_weights and ops.q4_applies(dtype, torch.device("cpu"))
    model = LlamaForCausalLM(config, weights, torch.float32, exact=exact if use_q4 else None)
    choice = tune_linears(model.linears(), LinearChoice(dtype, "benchmark"), TUNE_ROUNDS, log=False)
    shape = (2, blocks, block_size, config.num_key_value_heads, config.head_dim)
    kv = kv_dtype(dtype)
    caches = [torch.zeros(shape, dtype=kv) for _ in range(config.num_hidden_layers)]
    scales = None
    if kv == torch.float8_e4m3fn:
        unit = torch.ones(config.num_key_value_heads)
        scales = [(unit, unit)] * config.num_hidden_layers
    return _Candidate(model, [(c[0], c[1]) for c in caches], scales, choice)


def _step(cand: _Candidate, w: Workload, block_size: int) -> Callable[[], None]:
    """A closure running one step of ``w`` on ``cand`` (decoder and LM head)."""
    per_seq = -(-(w.context + w.new) // block_size)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(w.seqs)]
    decodes = w.seqs if w.new == 1 else 0
    meta, positions = build_attention_metadata(
        [w.context] * w.seqs, [w.new] * w.seqs, tables, decodes, block_size, torch.device("cpu")
    )
    ids = torch.randint(0, cand.model.config.vocab_size, (w.seqs * w.new,))
    last = torch.arange(w.new - 1, w.seqs * w.new, w.new)

    def run() -> None:
        hidden = cand.model.forward(ids, positions, meta, cand.kv, cand.scales)
        cand.model.compute_logits(hidden[last])

    return run


def measure(
    model_dir: str | Path,
    dtypes: Sequence[torch.dtype],
    steps: Sequence[Workload],
    kv_dtype: Callable[[torch.dtype], torch.dtype],
    q4_weights: bool = True,
    block_size: int = 16,
    layers: int = BENCH_LAYERS,
) -> PathChoice:
    """Time every step kind on a small copy of the model per candidate dtype (interleaved
    rounds, best of each: ``timing.compare_ms``) and ``choose`` among them.

    The decoder's share of a step is timed on ``layers`` layers and scaled to the
    model's depth (the LM head is timed whole).

    Args:
        model_dir: the HF checkpoint.
        dtypes: candidate weight dtypes, the conservative one first (it wins ties).
        steps: the step kinds (``workloads``).
        kv_dtype: the KV cache dtype the engine gives a weight dtype.
        q4_weights: also build 4-bit copies where they apply (as the engine would).
        block_size: KV block size.
        layers: decoder layers built per candidate.
    """
    full = load_model_config(model_dir)
    depth = min(layers, full.num_hidden_layers)
    config = dataclasses.replace(full, num_hidden_layers=depth)
    exact = _load_layers(model_dir, config, depth)
    blocks = max(w.seqs * -(-(w.context + w.new) // block_size) for w in steps)
    names = [str(dt).removeprefix("torch.") for dt in dtypes]
    timings: dict[str, dict[str, float]] = {n: {} for n in names}
    with torch.inference_mode():
        cands = {
            n: _build(config, exact, dt, kv_dtype, q4_weights, blocks, block_size)
            for n, dt in zip(names, dtypes, strict=True)
        }
        del exact
        scale = full.num_hidden_layers / depth
        for w in steps:
            runs = {n: _step(c, w, block_size) for n, c in cands.items()}
            heads = {n: _head(c, w) for n, c in cands.items()}
            whole = timing.compare_ms(runs, rounds=ROUNDS, warmup=1)
            head = timing.compare_ms(heads, rounds=ROUNDS, warmup=1)
            for n in names:
                # decoder (whole step less its head) scaled to the model's depth, plus the head
                timings[n][w.name] = max(whole[n] - head[n], 0.0) * scale + head[n]
    result = choose(timings)
    result.paths = {n: c.choice.name for n, c in cands.items()}
    return result


def _head(cand: _Candidate, w: Workload) -> Callable[[], object]:
    """The LM head alone on the rows ``w`` samples."""
    x = torch.randn(w.seqs, cand.model.config.hidden_size).to(cand.model.dtype)
    return lambda: cand.model.compute_logits(x)
