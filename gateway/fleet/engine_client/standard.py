"""What the standard engine protocols (smg-grpc-proto's VllmEngine, TrtllmService) share
on the gateway's side: a channel with the service token, health by polling, Abort on
cancel, the tokenizer as a zip, resumption through the prompt, the stream translation.

Translation rules every standard client follows:

- Mid-stream failover: these protocols have no resumed-tokens field, so the tokens a
  failed replica already streamed are appended to the prompt and max_tokens and
  min_tokens shrink by their number. The engine then treats them as prompt: penalties
  that count only output tokens (presence, frequency) do not see them, and an engine's
  stop rules start after them.
- Cancellation: cancelling the stream cancels the gRPC call and sends Abort(request_id),
  so the engine frees the request's KV blocks even where it does not watch the call.
- A stop token the request does not keep in its output (``include_stop_in_output``
  unset) is held back until the next chunk or the last one says whether it stopped
  the request; then it is dropped and named in ``stop_token_id``, as llm.v1 does.
- An engine-side abort the gateway did not ask for fails the attempt with UNAVAILABLE
  (failover resumes it elsewhere); "error" is llm.v1's ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import zipfile
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2 as smg_common_pb2  # type: ignore[import-untyped]

from common.service_auth import token_metadata
from common.tasks import cancel_and_wait
from gateway.fleet.engine_client.base import (
    ChannelSecurity,
    Metadata,
    NoTokenizerServed,
    TokenizerFetchError,
    refuse,
    rpc_error,
)
from gateway.fleet.engine_client.kv_events import PrefixIndex, PromptBlocks, follow
from llm.v1 import common_pb2, engine_pb2
from tokenizer_svc.tokenizer import MAX_TOKENIZER_BYTES, TOKENIZER_FILES

FINISH_REASONS = {
    "stop": common_pb2.STOP,
    "stop_word": common_pb2.STOP,
    "length": common_pb2.LENGTH,
    "error": common_pb2.ERROR,
}
ABORTED = "abort"
NOT_SERVED = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
)


@dataclass(slots=True)
class WirePiece:
    """One response of a standard protocol, read out: new tokens of a chunk, or the
    last message (``finish`` set) with every output token and the usage."""

    token_ids: list[int]
    logprobs: list[common_pb2.PositionLogprobs] = field(default_factory=list)
    finish: str = ""  # "" = a chunk; else the engine's finish reason
    output_ids: list[int] = field(default_factory=list)  # the last message's, cumulative
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    matched_token_id: int | None = None


def last_piece(
    c: Any, output_ids: Iterable[int], logprobs: list[common_pb2.PositionLogprobs]
) -> WirePiece:
    """The WirePiece of a protocol's GenerateComplete (the fields both protocols share)."""
    matched = c.matched_token_id if c.WhichOneof("matched_stop") == "matched_token_id" else None
    return WirePiece(
        token_ids=[],
        logprobs=logprobs,
        finish=c.finish_reason or "unknown",
        output_ids=list(output_ids),
        prompt_tokens=c.prompt_tokens,
        completion_tokens=c.completion_tokens,
        cached_tokens=c.cached_tokens,
        matched_token_id=matched,
    )


def position_logprobs(
    token_id: int, logprob: float, top: Iterable[tuple[int, float]], limit: int
) -> common_pb2.PositionLogprobs:
    """llm.v1's logprobs of one position: the ``limit`` best alternatives; the rank is
    the chosen token's place among them (past those better than it when not one)."""
    alts = sorted(top, key=lambda a: -a[1])[:limit]
    ranked = [i for i, (tid, _) in enumerate(alts) if tid == token_id]
    rank = ranked[0] + 1 if ranked else 1 + sum(1 for _, lp in alts if lp > logprob)
    return common_pb2.PositionLogprobs(
        chosen=common_pb2.TokenLogprob(token_id=token_id, logprob=logprob),
        rank=rank,
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in alts],
    )


def resumed_prompt(request: engine_pb2.EngineGenerateRequest) -> tuple[list[int], int, int]:
    """(prompt, max_tokens, min_tokens) with a failover's resumed tokens in the prompt."""
    resumed = list(request.resumed_output_token_ids)
    p = request.sampling
    return (
        [*request.prompt_token_ids, *resumed],
        p.max_tokens - len(resumed),
        max(0, p.min_tokens - len(resumed)),
    )


def check_request(request: engine_pb2.EngineGenerateRequest, engine: str) -> None:
    """Refuse what no standard protocol carries and the gateway cannot keep.

    Priority and tenant_weight are kept by the gateway's fair queue and per-replica
    concurrency, the deadline by the call's timeout, stop strings by the gateway.

    Raises:
        grpc.aio.AioRpcError: INVALID_ARGUMENT naming the field.
    """
    if request.HasField("speculative_decoding"):
        raise refuse(
            "speculative_decoding", engine, "the protocol has no per-request speculative switch"
        )
    if request.sampling.stop_sequences:
        raise refuse(
            "sampling.stop_sequences",
            engine,
            "the protocol stops on strings and single token ids, not token sequences",
        )


def guided_constraint(
    request: engine_pb2.EngineGenerateRequest, engine: str
) -> tuple[str, str | list[str]] | None:
    """The request's guided-decoding constraint as (llm.v1 field name, value), for a
    standard protocol to carry; None when unconstrained.

    Raises:
        grpc.aio.AioRpcError: INVALID_ARGUMENT for a Lark grammar (no standard protocol
            takes one) and for a guided request resumed after a failover (the protocols
            resume by extending the prompt, where the constraint would start over).
    """
    g = request.sampling.guided
    kind = g.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not g.json_object):
        return None
    if kind == "lark_grammar":
        raise refuse(
            "sampling.guided.lark_grammar",
            engine,
            "the standard protocols take JSON schemas, regexes, GBNF grammars, choices and "
            "structural tags, not Lark",
        )
    if request.resumed_output_token_ids:
        raise refuse(
            f"sampling.guided.{kind}",
            engine,
            "a resumed stream continues as a longer prompt, where the constraint would start over",
        )
    if kind == "choice":
        return kind, list(g.choice.choices)
    if kind == "json_object":
        return kind, ""
    return kind, str(getattr(g, kind))


def cache_salt(salt: str) -> int:
    """The request's prefix-cache salt (``EngineGenerateRequest.cache_salt``: the tenant's
    or its cache group's) as an int64, for protocols whose salt is a number."""
    digest = hashlib.blake2b(f"llm-gateway-cache\0{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class StandardStream:
    """One Generate call of a standard protocol as llm.v1 chunks.

    Args:
        call: The gRPC call.
        read: One wire response -> its ``WirePiece``.
        request: The llm.v1 request (id, stop ids, include_stop_in_output).
        hold: Token ids held back when they end a chunk (stops the engine may emit).
        reports_cached: Whether the engine's cached-token counts may reach the tenant.
        abort: Sends Abort(request_id) (scheduled, not awaited).
    """

    def __init__(
        self,
        call: Any,
        read: Callable[[Any], WirePiece],
        request: engine_pb2.EngineGenerateRequest,
        hold: frozenset[int],
        reports_cached: bool,
        abort: Callable[[str], None],
    ) -> None:
        self._call = call
        self._read = read
        self._request_id = request.request_id
        self._hold = frozenset() if request.sampling.include_stop_in_output else hold
        self._reports_cached = reports_cached
        self._abort = abort
        self._finished = False
        self._held: tuple[int, common_pb2.PositionLogprobs | None] | None = None
        self._num_received = 0  # tokens the engine streamed in this call

    def done(self) -> bool:
        return self._finished or bool(self._call.done())

    def cancel(self) -> bool:
        if self.done():
            return False
        self._finished = True
        self._call.cancel()
        self._abort(self._request_id)
        return True

    def __aiter__(self) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[engine_pb2.EngineGenerateResponse]:
        async for resp in self._call:
            piece = self._read(resp)
            if piece.finish:
                self._finished = True
                yield self._last(piece)
                return
            self._num_received += len(piece.token_ids)
            chunk = self._chunk(piece.token_ids, piece.logprobs)
            if chunk.token_ids:
                yield chunk

    def _with_held(
        self, ids: list[int], logprobs: list[common_pb2.PositionLogprobs]
    ) -> tuple[list[int], list[common_pb2.PositionLogprobs | None]]:
        lps: list[common_pb2.PositionLogprobs | None] = [*logprobs]
        lps += [None] * (len(ids) - len(lps))
        if self._held is not None:
            ids, lps = [self._held[0], *ids], [self._held[1], *lps]
            self._held = None
        return ids, lps

    def _response(
        self, ids: list[int], lps: list[common_pb2.PositionLogprobs | None]
    ) -> engine_pb2.EngineGenerateResponse:
        out = engine_pb2.EngineGenerateResponse(request_id=self._request_id, token_ids=ids)
        if all(lp is not None for lp in lps):  # logprobs of every token, or of none
            out.logprobs.extend(lp for lp in lps if lp is not None)
        return out

    def _chunk(
        self, new: list[int], logprobs: list[common_pb2.PositionLogprobs]
    ) -> engine_pb2.EngineGenerateResponse:
        ids, lps = self._with_held(new, logprobs)
        if ids and ids[-1] in self._hold:  # the next message says whether it stopped
            self._held = (ids.pop(), lps.pop())
        return self._response(ids, lps)

    def _last(self, piece: WirePiece) -> engine_pb2.EngineGenerateResponse:
        if piece.finish == ABORTED:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the engine aborted the request")
        tail = piece.output_ids[self._num_received :]  # what the chunks did not carry
        ids, lps = self._with_held(tail, piece.logprobs[-len(tail) :] if tail else [])
        finish = FINISH_REASONS.get(piece.finish, common_pb2.ERROR)
        stop_id = piece.matched_token_id
        # no stop strings go to the engine: a "stop" ends on EOS or a stop id, its last token
        if finish == common_pb2.STOP and ids and ids[-1] in self._hold:
            stop_id = ids.pop()
            lps.pop()
        out = self._response(ids, lps)
        out.finish_reason = finish
        if stop_id is not None and finish == common_pb2.STOP:
            out.stop_token_id = stop_id
        out.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=piece.prompt_tokens,
                completion_tokens=piece.completion_tokens,
                cached_prompt_tokens=piece.cached_tokens if self._reports_cached else 0,
            )
        )
        return out


class StandardClient:
    """The channel, credentials, health poll, Abort and tokenizer of a standard engine.

    Subclasses set ``protocol``, ``stub`` and the protocol's calls.

    Args:
        address: ``host:port``.
        service_token: Sent on every call ("" = none).
        security: Plaintext, TLS or mutual TLS.
        tls_name: The name its certificate is checked against.
        poll_interval_s: Health poll period.
        model / version: The model name and version to report ("" = the engine's own
            name; no version).
    """

    protocol = ""
    announces_tokenizer = False

    def __init__(
        self,
        address: str,
        service_token: str = "",
        security: ChannelSecurity | None = None,
        tls_name: str = "",
        *,
        poll_interval_s: float = 1.0,
        model: str = "",
        version: str = "",
    ) -> None:
        self.address = address
        self.metadata: Metadata = token_metadata(service_token)
        self.channel = (security or ChannelSecurity()).channel(address, tls_name)
        self.poll_interval_s = poll_interval_s
        self.model, self.version = model, version
        self._grpc_health: health_pb2_grpc.HealthStub | None = health_pb2_grpc.HealthStub(
            self.channel
        )
        self._aborts: set[asyncio.Task[None]] = set()
        self.stub: Any = None  # the protocol's stub (GetTokenizer, SubscribeKvEvents)
        self.prefix_index = PrefixIndex()
        self._follower: asyncio.Task[None] | None = None
        self._load: tuple[Any, float] | None = None  # the last EngineLoad, when it came

    @property
    def engine(self) -> str:
        """How messages name this engine."""
        return f"{self.protocol}://{self.address}"

    async def health_check(self, timeout_s: float) -> str:
        """The protocol's HealthCheck: "" = healthy, else why not."""
        raise NotImplementedError

    def wire_salt(self, cache_salt: str) -> str:
        """The request's cache salt as this protocol carries it and its KV events
        report it ("" = none)."""
        return ""

    def cached_tokens(self, prompt: PromptBlocks) -> int:
        return self.prefix_index.match(prompt, self.wire_salt(prompt.cache_salt))

    def prefix_blocks(self) -> int:
        return len(self.prefix_index)

    def recent_load(self, max_age_s: float) -> Any | None:
        """The engine's last load record from its KV event stream (``EngineLoad``) if
        it came within ``max_age_s``, else None."""
        if self._load is None:
            return None
        load, at = self._load
        return load if asyncio.get_running_loop().time() - at <= max_age_s else None

    def _on_load(self, load: Any) -> None:
        self._load = (load, asyncio.get_running_loop().time())

    def _subscribe(self, request: Any) -> Any:
        return self.stub.SubscribeKvEvents(request, metadata=self.metadata)

    async def watch_health(self) -> AsyncGenerator[str, None]:
        if self._follower is None:  # the replica watches health from its start on
            self._follower = asyncio.create_task(
                follow(self._subscribe, self.prefix_index, self._on_load, self.engine),
                name=f"kv-events-{self.address}",
            )
        while True:
            timeout_s = max(1.0, self.poll_interval_s)
            why = await self.health_check(timeout_s) or await self._standard_health(timeout_s)
            yield why
            await asyncio.sleep(self.poll_interval_s)

    async def _standard_health(self, timeout_s: float) -> str:
        """grpc.health.v1 where the engine offers it (asked until it says it does not)."""
        if self._grpc_health is None:
            return ""
        try:
            resp = await self._grpc_health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND):
                raise
            self._grpc_health = None
            return ""
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return "grpc.health.v1 says NOT_SERVING"
        return ""

    def schedule_abort(self, send: Callable[[], Awaitable[Any]]) -> None:
        """Send an Abort in the background (a cancelled call must not wait for it)."""

        async def run() -> None:
            # the engine gone, or the request already ended: nothing left to free
            with contextlib.suppress(grpc.aio.AioRpcError):
                await send()

        task = asyncio.ensure_future(run())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def tokenizer_files(self, digest: str, timeout_s: float) -> tuple[str, dict[str, bytes]]:
        try:
            call = self.stub.GetTokenizer(
                smg_common_pb2.GetTokenizerRequest(), timeout=timeout_s, metadata=self.metadata
            )
            sha, files = await read_tokenizer_zip(call, self.engine, call.cancel)
        except grpc.aio.AioRpcError as e:
            kind = NoTokenizerServed if e.code() in NOT_SERVED else TokenizerFetchError
            raise kind(
                f"GetTokenizer on {self.engine} failed ({e.code().name}: {e.details()})"
            ) from None
        if digest and sha != digest:
            raise TokenizerFetchError(f"engine {self.engine} sent a tokenizer other than {digest}")
        return sha, files

    async def close(self) -> None:
        if self._aborts:  # let the last aborts reach the engine, briefly
            await asyncio.wait(set(self._aborts), timeout=1.0)
        await cancel_and_wait(*self._aborts, self._follower)
        await self.channel.close(None)


async def read_tokenizer_zip(
    chunks: AsyncIterator[Any], source: str, cancel: Callable[[], Any]
) -> tuple[str, dict[str, bytes]]:
    """The sha256 and tokenizer files of a GetTokenizer zip stream (the engine's sha256
    on its last chunk must match the bytes; size capped; only the tokenizer files
    llm.v1 knows are kept, by base name).

    Raises:
        TokenizerFetchError: too large, a digest mismatch, or not a tokenizer zip.
    """
    data = bytearray()
    sha = ""
    async for chunk in chunks:
        data.extend(chunk.data)
        sha = chunk.sha256 or sha
        if len(data) > MAX_TOKENIZER_BYTES:
            cancel()
            raise TokenizerFetchError(
                f"engine {source} sent a tokenizer over {MAX_TOKENIZER_BYTES} bytes"
            )
    if not sha or hashlib.sha256(data).hexdigest() != sha.lower():
        raise TokenizerFetchError(
            f"the tokenizer zip from engine {source} does not match its sha256"
        )
    files: dict[str, bytes] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
            for entry in zf.infolist():
                name = PurePosixPath(entry.filename).name
                if entry.is_dir() or name not in TOKENIZER_FILES:
                    continue
                if name in files:
                    raise TokenizerFetchError(
                        f"the tokenizer zip from engine {source} has two {name}"
                    )
                room = MAX_TOKENIZER_BYTES - sum(len(b) for b in files.values())
                with zf.open(entry) as f:
                    body = f.read(room + 1)  # never trusts the entry's stated size
                if len(body) > room:
                    raise TokenizerFetchError(
                        f"the tokenizer from engine {source} unpacks to over "
                        f"{MAX_TOKENIZER_BYTES} bytes"
                    )
                files[name] = body
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as e:
        raise TokenizerFetchError(f"the tokenizer from engine {source} is not a zip: {e}") from None
    if "tokenizer.json" not in files:
        raise TokenizerFetchError(f"the tokenizer zip from engine {source} has no tokenizer.json")
    return sha.lower(), files
