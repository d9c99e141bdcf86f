"""What the standard-protocol servicers share: refusals, stop strings, the run loop,
the tokenizer bundle and the load snapshot.

Every protocol translates its request into a ``GenerateInput`` plus the stop strings,
then ``StandardEngine.run`` drives the backend exactly as the llm.v1 servicer does
(same draining, same in-flight count, same status for each failure), applying the
stop strings on the way: the engine core matches token ids only, so a stop string is
matched here, on the detokenized output, and a match ends the request (its KV blocks
are freed at once) with finish reason "stop" and the matched string.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.log import get_logger
from common.server import Context
from engine_svc.backends.base import Backend, GenerateInput
from engine_svc.core.outputs import RequestOutput
from engine_svc.core.request import FinishReason
from engine_svc.service import EngineServicer
from tokenizer_svc.tokenizer import TOKENIZER_FILES, TextTokenizer

log = get_logger(__name__)

BUNDLE_CHUNK_BYTES = 64 * 1024  # GetTokenizer's chunks
# the tokenizer files, plus the model files a remote tokenizer reads for special ids
BUNDLE_FILES = (*TOKENIZER_FILES, "config.json", "special_tokens_map.json")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so the same files give the same sha256


class UnsupportedFieldError(ValueError):
    """A request field this engine cannot apply (INVALID_ARGUMENT naming it)."""


def unsupported(protocol: str, field: str, why: str = "") -> UnsupportedFieldError:
    """The refusal of ``field``: nothing the engine cannot apply is dropped silently."""
    detail = f" ({why})" if why else ""
    return UnsupportedFieldError(
        f"{protocol}: {field} is set, and this engine does not support it{detail}; "
        "send the request without it"
    )


async def unimplemented(context: Context, protocol: str, rpc: str, why: str) -> None:
    """End an RPC this engine does not offer with UNIMPLEMENTED, saying why."""
    await context.abort(
        grpc.StatusCode.UNIMPLEMENTED, f"{protocol}.{rpc}: this engine does not offer it ({why})"
    )


def finish_name(reason: FinishReason | None) -> str:
    """The protocols' finish_reason string for the engine's reason."""
    return {
        FinishReason.STOP: "stop",
        FinishReason.LENGTH: "length",
        FinishReason.ABORT: "abort",
    }.get(reason or FinishReason.ERROR, "error")


class StopStrings:
    """Matches stop strings on the detokenized output of one request.

    ``add`` takes each step's new token ids and returns how many of them to keep and
    the matched string: the tokens up to and including the one that completed the
    first match (the text after it is never generated further). Like vLLM, no match
    counts before ``min_tokens`` outputs.
    """

    def __init__(self, tokenizer: TextTokenizer, stops: Sequence[str], min_tokens: int = 0) -> None:
        self._stops = [s for s in stops if s]
        self._detok = tokenizer.detokenizer(skip_special_tokens=True)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._tail = ""
        self._min_tokens = min_tokens
        self._seen = 0

    def add(self, token_ids: Sequence[int]) -> tuple[int, str | None]:
        for i, tid in enumerate(token_ids):
            delta = self._detok.add([tid])
            self._seen += 1
            if not delta:
                continue
            text = self._tail + delta
            checked = self._seen > self._min_tokens
            for stop in self._stops:
                # a match must end inside the new text (earlier ones were seen already)
                start = max(0, len(self._tail) - len(stop) + 1)
                if checked and stop in text[start:]:
                    return i + 1, stop
            self._tail = text[-self._longest :] if self._longest > 1 else ""
        return len(token_ids), None


def tokenizer_bundle(model_dir: str | Path) -> bytes:
    """A zip of the model's tokenizer files (GetTokenizer); b"" when it has none."""
    d = Path(model_dir)
    buf = io.BytesIO()
    names = [n for n in BUNDLE_FILES if (d / n).is_file()]
    if "tokenizer.json" not in names:
        return b""
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, (d / name).read_bytes())
    return buf.getvalue()


def bundle_chunks(bundle: bytes, size: int = BUNDLE_CHUNK_BYTES) -> list[tuple[bytes, str]]:
    """(data, sha256) pieces of the bundle: the sha256 of the whole zip on the last only."""
    digest = hashlib.sha256(bundle).hexdigest()
    pieces = [bundle[i : i + size] for i in range(0, len(bundle), size)] or [b""]
    return [(p, digest if i == len(pieces) - 1 else "") for i, p in enumerate(pieces)]


@dataclass(slots=True)
class Step:
    """One output of a run: the engine's output, trimmed at a matched stop string."""

    out: RequestOutput
    matched_stop: str | None = None


class StandardEngine:
    """The backend as the standard servicers see it, with the llm.v1 servicer's
    admission (draining, in-flight count) so a drain covers every protocol.

    Args:
        backend: The engine backend.
        engine: The llm.v1 servicer (its draining flag and in-flight count).
        model_name: The name the engine serves its model under.
        model_dir: Where the model's files are (GetModelInfo's model path).
        tokenizer: The model's tokenizer (stop strings); None = stop strings refused.
        bundle: The tokenizer zip GetTokenizer streams; b"" = none.
        version: The served model's version.
        build: The engine build string.
    """

    def __init__(
        self,
        backend: Backend,
        engine: EngineServicer,
        *,
        model_name: str,
        model_dir: str,
        tokenizer: TextTokenizer | None,
        bundle: bytes,
        version: str,
        build: str,
    ) -> None:
        self.backend = backend
        self.engine = engine
        self.model_name = model_name
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.bundle = bundle
        self.version = version
        self.build = build
        self.hf_config = _read_json(Path(model_dir) / "config.json")

    def stop_strings(
        self, protocol: str, stops: Sequence[str], min_tokens: int
    ) -> StopStrings | None:
        """The matcher for ``stops`` (None when there are none)."""
        if not any(stops):
            return None
        if self.tokenizer is None:
            raise unsupported(protocol, "stop", "the engine has no tokenizer to match strings")
        return StopStrings(self.tokenizer, stops, min_tokens)

    async def run(
        self, inp: GenerateInput, stops: StopStrings | None, context: Context
    ) -> AsyncIterator[Step]:
        """The request's outputs (the last one finished), through the llm.v1 servicer's
        admission and output loop (``EngineServicer.admit`` / ``outputs``): the same
        statuses, draining and in-flight count. A matched stop string ends the output
        it lands in; leaving early aborts the request."""
        await self.engine.admit(inp, context)
        matched: list[str | None] = [None]

        def edit(out: RequestOutput) -> RequestOutput:
            if stops is None or not out.new_token_ids:
                return out
            keep, matched[0] = stops.add(out.new_token_ids)
            return out if matched[0] is None else _stopped_at(out, keep)

        async for out in self.engine.outputs(inp, context.time_remaining(), context, edit=edit):
            yield Step(out, matched[0])

    async def tokenizer_chunks(
        self, protocol: str, context: Context
    ) -> AsyncIterator[tuple[bytes, str]]:
        """GetTokenizer's (data, sha256) pieces; FAILED_PRECONDITION without a tokenizer."""
        if not self.bundle:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{protocol}: this engine's model directory has no tokenizer.json; give the "
                "gateway the tokenizer files instead",
            )
        for piece in bundle_chunks(self.bundle):
            yield piece

    async def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            await self.backend.abort(rid)
            log.info("abort requested", request_id=rid)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stopped_at(out: RequestOutput, keep: int) -> RequestOutput:
    """``out`` cut after its first ``keep`` new tokens, finished by a stop string."""
    dropped = len(out.new_token_ids) - keep
    return dataclasses.replace(
        out,
        new_token_ids=out.new_token_ids[:keep],
        new_logprobs=out.new_logprobs[:keep] if out.new_logprobs else out.new_logprobs,
        finished=True,
        finish_reason=FinishReason.STOP,
        stop_token_id=None,
        num_output_tokens=out.num_output_tokens - dropped,
    )
