"""Engine token chunks -> client chunks: incremental detokenization, stop strings, usage.

One ``TextStream`` per request lives across every engine attempt, so after a
mid-stream failover the text continues exactly where it stopped: the token
ids already received are the ``resumed_output_token_ids`` of the next
attempt and are never detokenized or sent twice. It only turns tokens into text:
what the attempts did (sent, answered, which replica) is the dispatcher's
``AttemptProgress``.
"""

from __future__ import annotations

from gateway.domain import Chunk
from gateway.request.stop_strings import StopMatcher
from llm.v1 import common_pb2, engine_pb2
from tokenizer_svc.tokenizer import TextTokenizer


class TextStream:
    """The client-facing state of one completion.

    Args:
        request_id: Echoed in every chunk.
        tokenizer: For incremental detokenization (and logprob token texts).
        stops: Stop strings (trimmed from the output; finish_reason STOP).
        num_prompt_tokens: Reported in usage.
    """

    def __init__(
        self, request_id: str, tokenizer: TextTokenizer, stops: list[str], num_prompt_tokens: int
    ) -> None:
        self.request_id = request_id
        self._tok = tokenizer
        self._detok = tokenizer.detokenizer(skip_special_tokens=True)
        self._stops = StopMatcher(stops)
        self.num_prompt_tokens = num_prompt_tokens
        self.token_ids: list[int] = []  # every output token received, across attempts
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        """True once the last chunk was built."""
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def on_engine_chunk(self, resp: engine_pb2.EngineGenerateResponse) -> Chunk | None:
        """Consume one engine chunk; the client chunk to send, or None when nothing is new."""
        ids = list(resp.token_ids)
        self.token_ids.extend(ids)
        text = self._detok.add(ids)
        finish = resp.finish_reason
        if finish:
            text += self._detok.finish()
            self.num_cached_tokens = resp.usage.cached_prompt_tokens
        out = self._stops.feed(text)
        if self._stops.stopped:
            finish = common_pb2.STOP
        elif finish:
            out += self._stops.flush()
        if not (out or ids or finish):
            return None
        chunk = Chunk(
            request_id=self.request_id, text=out, token_ids=ids, logprobs=self._logprobs(resp)
        )
        if finish:
            self.finish_reason = finish
            chunk.finish_reason = finish
            chunk.usage = self.usage()
        return chunk

    def usage(self) -> common_pb2.Usage:
        """Prompt tokens, every output token received (all attempts), cached prompt tokens."""
        return common_pb2.Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=len(self.token_ids),
            cached_prompt_tokens=self.num_cached_tokens,
        )

    def _logprobs(
        self, resp: engine_pb2.EngineGenerateResponse
    ) -> list[common_pb2.PositionLogprobs]:
        out = []
        for lp in resp.logprobs:
            pos = common_pb2.PositionLogprobs()
            pos.CopyFrom(lp)
            pos.chosen.text = self._text(pos.chosen.token_id)
            for alt in pos.top:
                alt.text = self._text(alt.token_id)
            out.append(pos)
        return out

    def _text(self, token_id: int) -> str:
        return str(self._tok.tokenizer.decode([token_id], skip_special_tokens=False))
