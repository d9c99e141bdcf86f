"""Each served model's tokenizer, fetched from its engines, keyed by content digest.

An llm.v1 engine reports ``ModelInfo.tokenizer_digest`` and serves the files behind it
(``Engine.GetTokenizer``); a standard engine (VllmEngine, TrtllmService) announces none
and serves a zip whose sha256 becomes the digest once fetched (the engine client checks
it). Either way the gateway needs no model directory of its own and several models with
different vocabularies sit behind one gateway. A replica
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
from collections.abc import Coroutine, Iterable
from typing import Any

from common.log import get_logger
from gateway import metrics
from gateway.fleet.engine_client.base import EngineClient, NoTokenizerServed, TokenizerFetchError
from llm.v1 import engine_pb2
from tokenizer_svc.tokenizer import TextTokenizer, TokenizerFilesError, tokenizer_digest

log = get_logger(__name__)

__all__ = ["TokenizerFetchError", "TokenizerSet"]


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
        self, info: engine_pb2.ModelInfo, client: EngineClient, source: str
    ) -> TextTokenizer:
        """The tokenizer of ``info``, fetched through ``client`` unless already held (one
        fetch per announced digest however many replicas ask at once; a standard
        engine's zip is fetched to learn its digest, which is set in ``info``).

        Raises:
            TokenizerFetchError: Why the replica cannot be routed to.
        """
        if not client.announces_tokenizer:
            return await self._ensure_unannounced(info, client, source)
        digest = info.tokenizer_digest
        if not digest:
            return self._local(info, source)
        self._note_model(info.model, digest)
        held = self._by_digest.get(digest)
        if held is not None:
            return held
        return await self._single_flight(
            info.model, digest, source, self._fetch(info.model, digest, client, source)
        )

    def _local(self, info: engine_pb2.ModelInfo, source: str) -> TextTokenizer:
        if self.local is None:
            raise TokenizerFetchError(
                f"engine {source} serves no tokenizer for {info.model!r} and the "
                "gateway has none of its own (set gateway.model_dir)"
            )
        return self.local

    async def _ensure_unannounced(
        self, info: engine_pb2.ModelInfo, client: EngineClient, source: str
    ) -> TextTokenizer:
        t0 = time.perf_counter()
        try:
            digest, files = await client.tokenizer_files("", self.fetch_timeout_s)
        except NoTokenizerServed:
            return self._local(info, source)
        info.tokenizer_digest = digest
        self._note_model(info.model, digest)
        held = self._by_digest.get(digest)
        if held is not None:
            return held
        return await self._single_flight(
            info.model, digest, source, self._load(info.model, digest, files, source, t0)
        )

    async def _single_flight(
        self, model: str, digest: str, source: str, load: Coroutine[Any, Any, TextTokenizer]
    ) -> TextTokenizer:
        future = self._loading.get(digest)
        if future is None:
            if len(self._by_digest) + len(self._loading) >= self.max_tokenizers:
                load.close()
                raise TokenizerFetchError(
                    f"the gateway already holds {self.max_tokenizers} distinct tokenizers; "
                    f"not loading {model!r}'s from {source}"
                )
            future = asyncio.ensure_future(load)
            self._loading[digest] = future
            future.add_done_callback(lambda f: self._loaded(digest, f))
        else:
            load.close()
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
        self, model: str, digest: str, client: EngineClient, source: str
    ) -> TextTokenizer:
        t0 = time.perf_counter()
        _, whole = await client.tokenizer_files(digest, self.fetch_timeout_s)
        if tokenizer_digest(whole) != digest:
            raise TokenizerFetchError(
                f"the tokenizer files from engine {source} do not match their digest"
            )
        return await self._load(model, digest, whole, source, t0)

    async def _load(
        self, model: str, digest: str, files: dict[str, bytes], source: str, t0: float
    ) -> TextTokenizer:
        try:
            tok = await asyncio.to_thread(TextTokenizer.from_files, files)
        except TokenizerFilesError as e:
            raise TokenizerFetchError(f"engine {source}: {e}") from None
        self._by_digest[digest] = tok
        metrics.TOKENIZERS.set(len(self._by_digest))
        log.info(
            "tokenizer loaded",
            model=model,
            digest=digest[:12],
            source=source,
            bytes=sum(len(b) for b in files.values()),
            seconds=round(time.perf_counter() - t0, 3),
        )
        return tok
