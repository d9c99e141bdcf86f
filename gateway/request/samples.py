"""Parallel samples of one prompt (``GenerateRequest.n`` > 1).

Each sample is a request of its own through the whole pipeline (admission, limits and
budgets: n request units and leases, n times the output tokens; its own engine request,
tool output shaping and usage record), with the same prompt and the tenant's cache salt,
so the engines' prefix cache shares the prompt's full KV blocks between them. A seed
``s`` gives sample ``i`` the seed ``s + i`` (distinct, and repeatable). Their chunks are
merged into one stream as they come, each naming its sample (``Chunk.index``); each
sample ends with its own last chunk. A failure of one ends them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from gateway.domain import CallContext, Chunk
from llm.v1 import gateway_pb2

UINT64 = 1 << 64
Generate = Callable[[gateway_pb2.GenerateRequest, CallContext], AsyncGenerator[Chunk, None]]


def sample_requests(request: gateway_pb2.GenerateRequest) -> list[gateway_pb2.GenerateRequest]:
    """The n requests of one (each with n = 1 and its own seed)."""
    out = []
    for i in range(request.n):
        sub = gateway_pb2.GenerateRequest()
        sub.CopyFrom(request)
        sub.n = 1
        if request.sampling.HasField("seed"):
            sub.sampling.seed = (request.sampling.seed + i) % UINT64
        out.append(sub)
    return out


def sample_call(call: CallContext) -> CallContext:
    """A sample's own call context: the same caller, key and deadline, its own trace."""
    sub = dataclasses.replace(call)
    sub.request_id, sub.request_id_error = call.request_id, call.request_id_error
    sub.client_traceparent = call.client_traceparent
    sub.key_id, sub.key_budgets, sub.auth_at = call.key_id, call.key_budgets, call.auth_at
    return sub


async def merged(
    generate: Generate, request: gateway_pb2.GenerateRequest, call: CallContext
) -> AsyncGenerator[Chunk, None]:
    """Every sample's chunks, as they come, ``index`` set; the first error ends them all."""
    subs = [(sub, sample_call(call)) for sub in sample_requests(request)]
    queue: asyncio.Queue[tuple[Chunk | None, BaseException | None]] = asyncio.Queue(len(subs))

    async def pump(i: int, sub: gateway_pb2.GenerateRequest, sub_call: CallContext) -> None:
        try:
            async with contextlib.aclosing(generate(sub, sub_call)) as chunks:
                async for chunk in chunks:
                    chunk.index = i
                    await queue.put((chunk, None))
            await queue.put((None, None))
        except Exception as e:  # raised to the caller by the merge
            await queue.put((None, e))

    tasks = [asyncio.create_task(pump(i, s, c)) for i, (s, c) in enumerate(subs)]
    try:
        running = len(tasks)
        while running:
            chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
                continue
            call.ratelimit.update(subs[chunk.index][1].ratelimit)  # the front's headers
            yield chunk
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, sub_call in subs:  # an error's trailers carry what the samples saw
            call.ratelimit.update(sub_call.ratelimit)
