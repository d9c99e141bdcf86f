"""Sampler: each knob on hand-made logits; seeds independent of the batch."""

from __future__ import annotations

import math

import pytest
import torch

from engine_svc.core.request import Request
from engine_svc.core.sampler import Sampler
from engine_svc.core.sampling_params import SamplingParams

V = 8
CPU = torch.device("cpu")


def r(rid: str = "r", prompt: list[int] | None = None, **kw: object) -> Request:
    return Request.create(rid, prompt or [0], SamplingParams(**kw), 0.0, eos_token_ids=(1,))  # type: ignore[arg-type]


def row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32)


LOGITS = row(0.0, 1.0, 3.0, 2.5, -1.0, 0.5, 2.0, -2.0)


def test_greedy_is_argmax() -> None:
    s = Sampler(V, CPU)
    assert s(LOGITS.repeat(2, 1), [r("a"), r("b")]).token_ids == [2, 2]


@pytest.mark.parametrize("temperature", [1e-36, 5e-324, 1e-6])
def test_temperatures_so_small_that_logits_overflow_are_greedy(temperature: float) -> None:
    """logits / 1e-30 is inf in fp32 and softmax(inf) is NaN: such a request is greedy."""
    s = Sampler(V, CPU, seed=5)
    big = LOGITS * 1e4  # large logits overflow sooner
    reqs = [r("t", temperature=temperature, top_p=0.9), r("g")]
    for _ in range(5):
        assert s(big.repeat(2, 1), reqs).token_ids == [2, 2]


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    s = Sampler(V, CPU, seed=3)
    reqs = [r("k", temperature=1.5, top_k=1), r("p", temperature=1.5, top_p=0.01)]
    for _ in range(20):
        assert s(LOGITS.repeat(2, 1), reqs).token_ids == [2, 2]


def test_top_k_and_min_p_restrict_support() -> None:
    s = Sampler(V, CPU, seed=1)
    seen_k: set[int] = set()
    seen_m: set[int] = set()
    reqs = [r("k", temperature=2.0, top_k=3), r("m", temperature=1.0, min_p=0.5)]
    for _ in range(200):
        a, b = s(LOGITS.repeat(2, 1), reqs).token_ids
        seen_k.add(a)
        seen_m.add(b)
    assert seen_k == {2, 3, 6}
    # p >= 0.5 * p_max  <=>  logit >= 3 - ln 2 = 2.31
    assert seen_m == {2, 3}


def test_sampling_matches_the_distribution() -> None:
    s = Sampler(V, CPU, seed=7)
    n = 4000
    logits = LOGITS.repeat(n, 1)
    reqs = [r(str(i), temperature=1.0) for i in range(n)]
    counts = torch.bincount(torch.tensor(s(logits, reqs).token_ids), minlength=V).float()
    expected = torch.softmax(LOGITS[0], -1) * n
    assert torch.allclose(counts, expected, atol=4 * math.sqrt(n * 0.25))


def test_seed_is_independent_of_batch_composition() -> None:
    def run(batch: list[Request], logits: torch.Tensor) -> int:
        return Sampler(V, CPU, seed=11)(logits, batch).token_ids[0]

    target = r("t", temperature=1.0, seed=1234)
    alone = [run([target], LOGITS)]
    other = torch.randn(3, V)
    mixed = run(
        [target, r("x", temperature=0.7), r("y", temperature=1.0, seed=9), r("z")],
        torch.cat([LOGITS, other]),
    )
    assert alone == [mixed]
    draws = set()
    for pos in range(12):  # the draw moves on with the output position
        target.output_token_ids = [3] * pos
        draws.add(run([target], torch.zeros(1, V)))
    assert len(draws) > 1


def test_penalties() -> None:
    s = Sampler(V, CPU)
    rep_logits = row(-1, -1, -1, -1, 1.0, 0.5, -0.2, -1)
    rep = r(prompt=[4, 6], repetition_penalty=4.0)
    assert s(rep_logits, [rep]).token_ids == [5]  # 1.0 / 4 < 0.5
    rep.sampling_params.repetition_penalty = 0.1  # < 1 rewards repeats: -0.2 * 0.1 wins
    assert s(row(-1, -1, -1, -1, -1, -0.1, -0.2, -1), [rep]).token_ids == [6]
    pres = r(presence_penalty=2.0)
    pres.output_token_ids = [2]
    out = s(LOGITS, [pres]).token_ids
    assert out == [3]  # 3.0 - 2.0 < 2.5
    freq = r(frequency_penalty=0.3)
    freq.output_token_ids = [2, 2]
    assert s(LOGITS, [freq]).token_ids == [3]  # 3.0 - 0.6 < 2.5


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    s = Sampler(V, CPU)
    logits = row(0, 9, 8, 7, 0, 0, 0, 0)
    req = r(min_tokens=2, max_tokens=4, stop_token_ids=[2])
    assert s(logits, [req]).token_ids == [3]
    req.output_token_ids = [5, 5]
    assert s(logits, [req]).token_ids == [1]
    assert s(logits, [r(min_tokens=2, ignore_eos=True, max_tokens=4)]).token_ids == [1]


def test_logprobs_are_raw_with_ranks() -> None:
    s = Sampler(V, CPU)
    req = r(logprobs=3, temperature=0.0, presence_penalty=2.0)
    req.output_token_ids = [2]
    out = s(LOGITS, [req, r("n")])
    lp = out.logprobs[0]
    assert lp is not None
    raw = torch.log_softmax(LOGITS[0], -1)
    assert lp.token_id == 3
    assert lp.rank == 2
    assert lp.logprob == pytest.approx(float(raw[3]))
    assert lp.top_token_ids == [2, 3, 6]
    assert lp.top_logprobs == pytest.approx(raw[[2, 3, 6]].tolist())
    assert out.logprobs[1] is None
