"""Each served model's tokenizer, fetched from its engines, keyed by content digest.

An engine reports ``ModelInfo.tokenizer_digest`` and serves the files behind it
(``Engine.GetTokenizer``), so the gateway needs no model directory of its own and
several models with different vocabularies sit behind one gateway. A replica
becomes routable only once its tokenizer is here (``Replica`` calls ``ensure``
when it turns healthy), so a request never waits for a download: the pipeline's
``get`` is a dictionary lookup.

Engines are a trust boundary too: the pieces are capped in size, the files must
hash to the digest the engine announced, and at most ``max_tokenizers`` distinct
tokenizers are held (the pool drops those no replica reports any more).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence

import grpc

from common.log import get_logger
from gateway import metrics
from llm.v1 import engine_pb2, engine_pb2_grpc
from tokenizer_svc.tokenizer import (
    MAX_TOKENIZER_BYTES,
    TextTokenizer,
    TokenizerFilesError,
    tokenizer_digest,
)

log = get_logger(__name__)


class TokenizerFetchError(Exception):
    """A replica's tokenizer could not be had; the replica stays out of routing."""


class TokenizerSet:
    """Tokenizers by digest, shared by every replica of the pool.

    Args:
        local: Tokenizer for replicas that serve none (``gateway.model_dir``; None = such
            replicas are not routable).
        max_tokenizers: Distinct tokenizers held at most.
        fetch_timeout_s: Budget of one GetTokenizer call.
    """

    def __init__(
        self,
        local: TextTokenizer | None = None,
        *,
        max_tokenizers: int = 16,
        fetch_timeout_s: float = 60.0,
    ) -> None:
        self.local = local
        self.max_tokenizers = max_tokenizers
        self.fetch_timeout_s = fetch_timeout_s
        self._by_digest: dict[str, TextTokenizer] = {}
        self._loading: dict[str, asyncio.Future[TextTokenizer]] = {}
        self._digest_of: dict[str, str] = {}  # model -> the digest its replicas reported

    def __len__(self) -> int:
        return len(self._by_digest)

    def get(self, info: engine_pb2.ModelInfo) -> TextTokenizer | None:
        """The tokenizer of the model ``info`` describes, if held (None = not loaded)."""
        if not info.tokenizer_digest:
            return self.local
        return self._by_digest.get(info.tokenizer_digest)

    async def ensure(
        self,
        info: engine_pb2.ModelInfo,
        stub: engine_pb2_grpc.EngineAsyncStub,
        metadata: Sequence[tuple[str, str]],
        source: str,
    ) -> TextTokenizer:
        """The tokenizer of ``info``, fetched through ``stub`` unless already held (one
        fetch per digest however many replicas ask at once).

        Raises:
            TokenizerFetchError: Why the replica cannot be routed to.
        """
        digest = info.tokenizer_digest
        if not digest:
            if self.local is None:
                raise TokenizerFetchError(
                    f"engine {source} serves no tokenizer for {info.model!r} and the "
                    "gateway has none of its own (set gateway.model_dir)"
                )
            return self.local
        self._note_model(info.model, digest)
        held = self._by_digest.get(digest)
        if held is not None:
            return held
        future = self._loading.get(digest)
        if future is None:
            if len(self._by_digest) + len(self._loading) >= self.max_tokenizers:
                raise TokenizerFetchError(
                    f"the gateway already holds {self.max_tokenizers} distinct tokenizers; "
                    f"not loading {info.model!r}'s from {source}"
                )
            future = asyncio.ensure_future(self._fetch(info.model, digest, stub, metadata, source))
            self._loading[digest] = future
            future.add_done_callback(lambda f: self._loaded(digest, f))
        return await asyncio.shield(future)

    def _loaded(self, digest: str, future: asyncio.Future[TextTokenizer]) -> None:
        self._loading.pop(digest, None)
        if not future.cancelled():
            future.exception()  # retrieved: every waiter may have gone; the next one retries

    def retain(self, digests: Iterable[str]) -> None:
        """Drop the tokenizers whose digest is not in ``digests`` (no replica reports it)."""
        keep = set(digests)
        for digest in [d for d in self._by_digest if d not in keep]:
            del self._by_digest[digest]
            log.info("tokenizer dropped", digest=digest[:12])
        self._digest_of = {m: d for m, d in self._digest_of.items() if d in keep}
        metrics.TOKENIZERS.set(len(self._by_digest))

    def _note_model(self, model: str, digest: str) -> None:
        before = self._digest_of.setdefault(model, digest)
        if before != digest:
            # versions of one model are tokenized with the tokenizer of the version the
            # request was admitted for; a canary that changes the vocabulary is unsafe
            log.warning(
                "replicas of one model report different tokenizers",
                model=model,
                digests=[before[:12], digest[:12]],
            )
            self._digest_of[model] = digest

    async def _fetch(
        self,
        model: str,
        digest: str,
        stub: engine_pb2_grpc.EngineAsyncStub,
        metadata: Sequence[tuple[str, str]],
        source: str,
    ) -> TextTokenizer:
        t0 = time.perf_counter()
        files: dict[str, bytearray] = {}
        sizes: dict[str, int] = {}
        total = 0
        try:
            call = stub.GetTokenizer(
                engine_pb2.GetTokenizerRequest(),
                timeout=self.fetch_timeout_s,
                metadata=tuple(metadata),
            )
            async for piece in call:
                total += len(piece.data)
                if piece.digest != digest or total > MAX_TOKENIZER_BYTES:
                    call.cancel()
                    raise TokenizerFetchError(
                        f"engine {source} sent a tokenizer other than the one it announced "
                        f"or over {MAX_TOKENIZER_BYTES} bytes"
                    )
                files.setdefault(piece.name, bytearray()).extend(piece.data)
                sizes[piece.name] = piece.file_size
        except grpc.aio.AioRpcError as e:
            raise TokenizerFetchError(
                f"GetTokenizer on {source} failed ({e.code().name}: {e.details()})"
            ) from None
        whole = {name: bytes(data) for name, data in files.items()}
        if any(len(whole[n]) != sizes[n] for n in whole) or tokenizer_digest(whole) != digest:
            raise TokenizerFetchError(
                f"the tokenizer files from engine {source} do not match their digest"
            )
        try:
            tok = await asyncio.to_thread(TextTokenizer.from_files, whole)
        except TokenizerFilesError as e:
            raise TokenizerFetchError(f"engine {source}: {e}") from None
        self._by_digest[digest] = tok
        metrics.TOKENIZERS.set(len(self._by_digest))
        log.info(
            "tokenizer loaded",
            model=model,
            digest=digest[:12],
            source=source,
            bytes=total,
            seconds=round(time.perf_counter() - t0, 3),
        )
        return tok
