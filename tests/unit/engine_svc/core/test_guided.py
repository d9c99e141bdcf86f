"""Guided decoding in the native engine, over the tiny random Llama with a one-character-
per-token tokenizer: whatever the weights say, every output fits its constraint, EOS
comes only where the constraint is complete, a completed constraint stops the request,
drafts are off, resumed tokens advance the matcher, malformed constraints are refused
before anything is queued, and every KV block returns to the pool."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_svc.core import LLMEngine, SamplingParams
from engine_svc.core.guided import GuidedCompiler, GuidedSpec
from engine_svc.core.guided_mask import PendingMasks, apply_bitmask, bitmask_width, unpack
from engine_svc.core.request import FinishReason
from tests.support.engine_config import engine_config
from tests.unit.engine_svc.conftest import write_tiny_model
from tests.unit.engine_svc.helpers import run_to_completion, tokens_of

EOS = 1
CHARS = [chr(c) for c in range(33, 127)]  # token i + 2 is CHARS[i]; 0 <s>, 1 </s>
VOCAB = 2 + len(CHARS)


def tiny_tokenizer() -> dict[str, Any]:
    special = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False}
        | {"normalized": False, "special": True}
        for i, c in enumerate(["<s>", "</s>"])
    ]
    model: dict[str, Any] = {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False}
    model |= {"continuing_subword_prefix": None, "end_of_word_suffix": None}
    model |= {"byte_fallback": False, "merges": []}
    model["vocab"] = {"<s>": 0, "</s>": 1} | {c: i + 2 for i, c in enumerate(CHARS)}
    decoder = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    return {
        "version": "1.0",
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": decoder | {"use_regex": False},
        "model": model,
    }


def text(ids: list[int]) -> str:
    return "".join(CHARS[t - 2] for t in ids if t >= 2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_tiny_model(tmp_path_factory.mktemp("tiny-guided"), seed=3)
    (d / "tokenizer.json").write_text(json.dumps(tiny_tokenizer()))
    return d


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(
        engine_config(
            model_dir=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=128,
            max_num_batched_tokens=64,
            enable_speculative_decoding=True,
            num_speculative_tokens=3,
            tune_linear_paths=False,
        )
    )


def generate(
    engine: LLMEngine, specs: Sequence[GuidedSpec | None], **params: Any
) -> list[tuple[list[int], FinishReason | None, int | None]]:
    """Run one request per spec in one batch: (output ids, finish reason, stop token)."""
    for i, spec in enumerate(specs):
        sp = SamplingParams(max_tokens=params.pop("max_tokens", 24), guided=spec, **params)
        engine.add_request(f"r{i}", [5, 6, 7, 8, 9], sp)
        params["max_tokens"] = sp.max_tokens
    outs = run_to_completion(engine)
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0
    result = []
    for i in range(len(specs)):
        o = outs[f"r{i}"]
        result.append((tokens_of(o), o[-1].finish_reason, o[-1].stop_token_id))
    return result


REGEXES = [r"[a-c]{2,5}", r"x(yz)*", r"[0-9]+\.[0-9]", r"(cat|dog|bird)s?", r"\{[a-z]+\}"]


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    regexes=st.lists(st.sampled_from(REGEXES), min_size=1, max_size=4),
    temperature=st.sampled_from([0.0, 1.0, 1.5]),
    seed=st.integers(0, 2**32),
    unguided=st.booleans(),
)
def test_every_output_fits_its_regex_and_eos_comes_only_when_complete(
    engine: LLMEngine, regexes: list[str], temperature: float, seed: int, unguided: bool
) -> None:
    specs: list[GuidedSpec | None] = [GuidedSpec("regex", r) for r in regexes]
    if unguided:
        specs.append(None)  # shares the batch and stays unconstrained
    results = generate(engine, specs, temperature=temperature, seed=seed, max_tokens=12)
    for spec, (ids, reason, stop) in zip(specs, results, strict=True):
        if spec is None:
            continue
        out = text(ids)
        matcher = engine.guided.matcher(spec)
        assert all(matcher.advance(t) for t in ids), (spec.text, out)  # every token allowed
        assert all(t >= 2 for t in ids)  # no <s>, and EOS only as the (withheld) stop
        if reason == FinishReason.STOP:
            assert re.fullmatch(spec.text, out), (spec.text, out)
            assert stop in (None, EOS)
        else:
            assert reason == FinishReason.LENGTH
            assert len(ids) == 12


def test_a_complete_constraint_stops_without_eos_and_choice_picks_one(engine: LLMEngine) -> None:
    choice = GuidedSpec.choice(["north", "south", "east"])
    fixed = GuidedSpec("regex", "[a-z]{3}")
    (c_ids, c_reason, _), (f_ids, f_reason, f_stop) = generate(engine, [choice, fixed])
    assert text(c_ids) in {"north", "south", "east"}
    assert c_reason == FinishReason.STOP
    assert len(f_ids) == 3
    assert f_reason == FinishReason.STOP
    assert f_stop is None


def test_json_and_grammar_constraints(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    specs = [
        GuidedSpec("json_schema", json.dumps(schema)),
        GuidedSpec("grammar", 'root ::= "<" [0-9] [0-9]? ">"'),
        GuidedSpec("lark_grammar", 'start: "(" NUM ")"\nNUM: /[0-9]/'),
    ]
    results = generate(engine, specs, max_tokens=40)
    (j_ids, j_reason, _), (g_ids, g_reason, _), (l_ids, l_reason, _) = results
    if j_reason == FinishReason.STOP:
        assert json.loads(text(j_ids))["k"] in ("a", "b")
    assert g_reason == FinishReason.STOP
    assert re.fullmatch(r"<[0-9]{1,2}>", text(g_ids))
    assert l_reason == FinishReason.STOP
    assert re.fullmatch(r"\([0-9]\)", text(l_ids))


def test_guided_requests_never_speculate(engine: LLMEngine) -> None:
    engine.add_request(
        "s", [5, 6, 5, 6, 5, 6], SamplingParams(max_tokens=10, guided=GuidedSpec("regex", "(ab)+"))
    )
    outs = run_to_completion(engine)["s"]
    assert outs[-1].num_draft_tokens == 0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GuidedSpec("json_schema", '{"type": "nope"}'), "guided.json_schema"),
        (GuidedSpec("json_schema", "{not json"), "not valid JSON"),
        (GuidedSpec("regex", "[a-"), "guided.regex"),
        (GuidedSpec("grammar", "root ::= missing"), "guided.grammar"),
        (GuidedSpec("lark_grammar", "start: nothing"), "guided.lark_grammar"),
        (GuidedSpec("structural_tag", "[]"), "guided.structural_tag"),
        (GuidedSpec("regex", ""), "guided.regex is empty"),
        (GuidedSpec("xml"), "unknown constraint"),
    ],
)
def test_malformed_constraints_are_refused_before_anything_is_queued(
    engine: LLMEngine, spec: GuidedSpec, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("bad", [5, 6], SamplingParams(max_tokens=4, guided=spec))
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.block_pool.num_used_blocks == 0


def test_resumed_tokens_advance_the_matcher(engine: LLMEngine) -> None:
    spec = GuidedSpec("regex", "[a-c]{4}")
    a, b = CHARS.index("a") + 2, CHARS.index("b") + 2
    engine.add_request(
        "res", [5, 6], SamplingParams(max_tokens=8, guided=spec), resumed_output_token_ids=[a, b]
    )
    ids = tokens_of(run_to_completion(engine)["res"])
    assert len(ids) == 2
    assert re.fullmatch("[a-c]{2}", text(ids))
    with pytest.raises(ValueError, match="resumed_output_token_ids: token 1"):
        engine.add_request(
            "res2",
            [5, 6],
            SamplingParams(max_tokens=8, guided=spec),
            resumed_output_token_ids=[a, 9],
        )
    assert not engine.has_unfinished_requests()


def test_compiled_constraints_are_cached_in_a_bounded_lru(model_dir: Path) -> None:
    compiler = GuidedCompiler(model_dir / "tokenizer.json", VOCAB, [EOS], max_entries=2)
    specs = [GuidedSpec("regex", f"a{{{n}}}") for n in range(1, 4)]
    for s in specs:
        compiler.matcher(s)
    assert len(compiler) == 2
    assert compiler.misses == 3
    assert compiler.cached(specs[0]) is None  # the least recently used went first
    assert compiler.cached(specs[2]) is not None
    assert compiler.hits == 1
    one, two = compiler.matcher(specs[2]), compiler.matcher(specs[2])
    assert one.matcher is not two.matcher  # every request gets its own copy
    missing = GuidedCompiler(model_dir / "missing.json", VOCAB, [EOS])
    missing.preload()  # left to the first guided request to report
    assert not missing.tokenizer_loaded
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        missing.matcher(specs[0])


def test_the_engine_builds_the_tokenizer_at_start(engine: LLMEngine) -> None:
    assert engine.guided.tokenizer_loaded  # no first guided request waits for it


def test_concurrent_requests_for_one_constraint_compile_it_once(model_dir: Path) -> None:
    compiler = GuidedCompiler(model_dir / "tokenizer.json", VOCAB, [EOS])
    compile_one = compiler._compile

    def slow_compile(spec: GuidedSpec) -> Any:
        time.sleep(0.2)  # the others arrive while it compiles
        return compile_one(spec)

    compiler._compile = slow_compile  # type: ignore[method-assign]
    spec = GuidedSpec("regex", "[a-c]{3}")
    start = threading.Barrier(4)
    got: list[Any] = []

    def request() -> None:
        start.wait()
        got.append(compiler.matcher(spec).matcher)

    threads = [threading.Thread(target=request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiler.misses == 1
    assert compiler.hits == 3
    assert len({id(m) for m in got}) == 4  # each its own copy
    with pytest.raises(ValueError, match=r"guided\.regex"):
        compiler.matcher(GuidedSpec("regex", "[a-"))  # a failed compile frees its gate
    assert not compiler._compiling


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(1, 80),
    greedy=st.lists(st.booleans(), min_size=1, max_size=5),
)
def test_greedy_guided_rows_get_the_best_allowed_token_and_drawing_rows_their_mask(
    data: st.DataObject, vocab: int, greedy: list[bool]
) -> None:
    rows = data.draw(st.lists(st.booleans(), min_size=len(greedy), max_size=len(greedy)))
    guided = [i for i, g in enumerate(rows) if g] or [0]
    bits = st.lists(st.booleans(), min_size=vocab, max_size=vocab)
    allowed = torch.tensor(data.draw(st.lists(bits, min_size=len(guided), max_size=len(guided))))
    allowed[:, 0] |= ~allowed.any(dim=1)  # a constraint allows something
    padded = torch.zeros(len(guided), bitmask_width(vocab) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (padded.view(len(guided), -1, 32) * weights).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    n = len(greedy) * vocab
    values = data.draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))  # many ties
    logits = torch.tensor(values, dtype=torch.float32).view(len(greedy), vocab)
    done: Future[None] = Future()
    done.set_result(None)
    masks = PendingMasks(guided, bitmask, done)
    out = masks.apply(logits, skip=greedy)
    chosen = out.argmax(dim=-1)
    masks.argmax(out, chosen, greedy)
    full = apply_bitmask(logits, guided, bitmask)
    for i, g in enumerate(greedy):
        if g or i not in guided:
            assert int(chosen[i]) == int(full[i].argmax())  # first maximum of what is allowed
        if not g:
            assert torch.equal(out[i], full[i])


@settings(max_examples=30, deadline=None)
@given(
    words=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4 * 3),
    vocab=st.integers(1, 96),
    rows=st.lists(st.booleans(), min_size=1, max_size=4),
)
def test_bitmask_unpacks_bit_j_of_word_w_as_token_32w_plus_j(
    words: list[int], vocab: int, rows: list[bool]
) -> None:
    width = bitmask_width(vocab)
    guided = [i for i, g in enumerate(rows) if g] or [0]
    data = (words * (width * len(guided)))[: width * len(guided)]
    bitmask = torch.tensor(data, dtype=torch.int32).view(len(guided), width)
    allowed = unpack(bitmask, vocab)
    for k in range(len(guided)):
        for t in range(vocab):
            assert bool(allowed[k, t]) == bool((data[k * width + t // 32] >> (t % 32)) & 1)
    logits = torch.randn(len(rows), vocab)
    out = apply_bitmask(logits, guided, bitmask)
    for i in range(len(rows)):
        if i in guided:
            k = guided.index(i)
            assert torch.equal(out[i] == float("-inf"), ~allowed[k])
        else:
            assert torch.equal(out[i], logits[i])  # unguided rows untouched


def test_a_structural_tag_constrains_only_what_follows_its_trigger(model_dir: Path) -> None:
    compiler = GuidedCompiler(model_dir / "tokenizer.json", VOCAB, [EOS])
    tag = {
        "structures": [{"begin": "<f=", "schema": {"type": "integer"}, "end": ">"}],
        "triggers": ["<f"],
    }
    spec = GuidedSpec("structural_tag", json.dumps(tag))

    def fits(s: str) -> bool:
        m = compiler.matcher(spec)
        return all(m.advance(CHARS.index(c) + 2) for c in s)

    assert fits("free_text<f=12>more")
    assert not fits("free_text<f=x")
