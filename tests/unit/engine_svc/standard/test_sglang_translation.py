"""SglangScheduler's translation, proto <-> domain (no server, no model): SGLang's
sampling names and defaults, its constraints, its logprob flags, and what this engine
cannot apply refused by name."""

from __future__ import annotations

from typing import Any

import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine_svc.core.outputs import ModelInfo
from engine_svc.standard import sglang_scheduler as sgl
from engine_svc.standard.shared import UnsupportedFieldError

INFO = ModelInfo(model="m", max_context_length=100, vocab_size=1000, eos_token_ids=[2])


def sreq(request: dict[str, Any] | None = None, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="r",
        tokenized=pb.TokenizedInput(input_ids=[5, 6, 7]),
        sampling_params=pb.SamplingParams(**sampling),
        **(request or {}),
    )


def test_sglang_defaults() -> None:
    inp, stops = sgl.generate_input_from_sglang(sreq(top_k=-1), INFO)
    p = inp.sampling_params
    assert (inp.prompt_token_ids, stops) == ([5, 6, 7], [])
    assert (p.max_tokens, p.top_k, p.top_p, p.repetition_penalty) == (97, 0, 1.0, 1.0)
    assert (p.logprobs, p.seed, p.guided) == (0, None, None)


def test_sglang_fields_map_to_the_engine() -> None:
    req = sreq(
        {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": -1},
        temperature=0.5,
        max_new_tokens=9,
        min_new_tokens=2,
        top_k=4,
        stop=["\n\n"],
        stop_token_ids=[3],
        ignore_eos=True,
        no_stop_trim=True,
        ebnf_grammar='root ::= "a"',
    )
    inp, stops = sgl.generate_input_from_sglang(req, INFO)
    p = inp.sampling_params
    assert (p.max_tokens, p.min_tokens, p.top_k, p.logprobs) == (9, 2, 4, 3)
    assert p.temperature == pytest.approx(0.5)
    assert (p.stop_token_ids, p.ignore_eos, p.include_stop_in_output) == ([3], True, True)
    assert stops == ["\n\n"]
    assert p.guided is not None
    assert (p.guided.kind, p.guided.text) == ("grammar", 'root ::= "a"')
    asked = {"return_logprob": True, "logprob_start_len": -1}
    lp = sgl.generate_input_from_sglang(sreq(asked), INFO)[0]
    assert lp.sampling_params.logprobs == 1  # the chosen token's logprob at least


@pytest.mark.parametrize(
    ("field", "fields", "sampling"),
    [
        ("sampling_params.n", {}, {"n": 2}),
        ("sampling_params.logit_bias", {}, {"logit_bias": {"5": 1.0}}),
        ("lora_id", {"lora_id": "a"}, {}),
        ("logprob_start_len", {"logprob_start_len": 0, "return_logprob": True}, {}),
        ("token_ids_logprob", {"token_ids_logprob": [4]}, {}),
        ("data_parallel_rank", {"data_parallel_rank": 1}, {}),
        ("input_embeds", {"input_embeds": [0.5]}, {}),
    ],
)
def test_sglang_refusals_name_the_field(
    field: str, fields: dict[str, Any], sampling: dict[str, Any]
) -> None:
    with pytest.raises(UnsupportedFieldError, match=field):
        sgl.generate_input_from_sglang(sreq(fields, **sampling), INFO)


def test_sglang_missing_input_is_invalid() -> None:
    with pytest.raises(ValueError, match="input_ids"):
        sgl.generate_input_from_sglang(pb.GenerateRequest(request_id="r"), INFO)
