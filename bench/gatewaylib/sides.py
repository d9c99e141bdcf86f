"""The sides of ``bench.gateway_bench``: one client per way to reach the engine, each
yielding a function that makes one timed request.

``engine`` (the engine's gRPC API directly), ``floor`` (the bare relay,
``bench.gatewaylib.relay_floor``) and ``gateway`` (the gateway's gRPC front) send the
same greedy request (the same prompt tokens, ``max_tokens`` tokens, ignore_eos);
``http`` is the same request as ``POST /v1/completions`` with ``stream: true``
(aiohttp client, time to the first SSE event carrying text), ``openai`` the same with
the official client (httpx) and ``curl`` with ``curl -N`` (its time to the first
byte; no gaps).

Over a stock vLLM engine (``--engine stock-vllm``, ``bench.gatewaylib.stock``) the
addresses name ``engine_protocol: vllm``: the ``engine`` side then sends the same
request as VllmEngine's ``Generate`` (smg-grpc-proto: the prompt's token ids, greedy,
``max_tokens``, ignore_eos, streamed), and the ``smg`` side is SMG's OpenAI API, the
``http`` side's request (aiohttp) with the model named as SMG lists it.

Inter-token time is measured two ways: per token (gRPC sides: a chunk with n tokens
counts n arrivals), and per text-bearing event, which is what a streaming user sees
and the only thing an SSE client can count (the incremental detokenizer sends no
event for a token that completes no character).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb  # type: ignore[import-untyped]
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_grpc  # type: ignore[import-untyped]

from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc

# Sent raw (no chat template). Its greedy continuation is text from the first token on:
# without the trailing blank line the model's first token is <|im_end|>, which the
# detokenizer drops, so every "first text" figure would hold one decode step more than
# TTFT and every "event gap" two tokens.
PROMPT = "Write a short poem about the sea and the wind, in four lines.\n\n"
SIDES = ["engine", "floor", "gateway", "http", "openai"] + (
    ["curl"] if shutil.which("curl") else []
)
# seconds: time to the first token, mean gap per token, mean gap per text event, time to
# the first text event
Sample = tuple[float, float, float, float]


def sample(t0: float, token_stamps: list[float], event_stamps: list[float]) -> Sample:
    """TTFT to the first token and to the first text event, and the mean gaps between
    tokens and between events."""

    def gap(stamps: list[float]) -> float:
        return (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)

    events = event_stamps or token_stamps
    return token_stamps[0] - t0, gap(token_stamps), gap(events), events[0] - t0


async def timed_stream(stream: Any) -> Sample:
    t0 = time.perf_counter()
    stamps: list[float] = []
    events: list[float] = []
    async for chunk in stream:
        now = time.perf_counter()
        stamps.extend(now for _ in chunk.token_ids)
        if chunk.token_ids and getattr(chunk, "text", "x"):  # engine chunks carry no text
            events.append(now)
    return sample(t0, stamps, events)


OneRequest = Callable[[], Awaitable[Sample]]


@contextlib.asynccontextmanager
async def side_client(
    side: str,
    addresses: dict[str, str],
    key: str,
    ids: list[int],
    max_tokens: int,
    connections: int = 1,
) -> AsyncIterator[OneRequest]:
    """A client for ``side`` (its channel or session open, one untimed request done
    where the side keeps a connection), yielding the function that makes one timed
    request: ``engine``, ``floor`` (the bare relay) and ``gateway`` over gRPC; ``http``
    (aiohttp), ``openai`` (the official client, httpx) and ``curl`` (``curl -N``) through
    the HTTP front. The gRPC sides spread their requests over ``connections`` channels,
    each its own TCP connection (as many clients, or Envoy's per-thread upstream
    connections, would), so a gateway's workers all get some."""
    if side in ("engine", "floor", "work", "gateway"):
        async with contextlib.AsyncExitStack() as stack:
            own = [("grpc.use_local_subchannel_pool", 1)] if connections > 1 else []
            channels = [
                await stack.enter_async_context(grpc.aio.insecure_channel(addresses[side], own))
                for _ in range(connections)
            ]
            protocol = addresses.get("engine_protocol", "llm")
            ones = [_grpc_one(side, ch, key, ids, max_tokens, protocol) for ch in channels]
            turn = itertools.count()
            for one in ones[1:]:
                await one()  # opens that channel's connection (the first opens on its own)

            async def spread() -> Sample:
                return await ones[next(turn) % len(ones)]()

            yield spread if connections > 1 else ones[0]
    elif side in ("http", "smg", "smg-tenant"):
        import aiohttp

        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=300), connector=aiohttp.TCPConnector(limit=0)
        ) as session:
            body = completions_body(max_tokens, addresses.get(f"{side}_model", ""))
            # SMG with a tenant takes its own key (the gateway's is the bench tenant's)
            one = _aiohttp_one(session, addresses[side], addresses.get(f"{side}_key", key), body)
            await one()  # opens the connection (a gRPC channel is open already too)
            yield one
    elif side == "openai":
        from openai import AsyncOpenAI

        async with AsyncOpenAI(
            base_url=f"{addresses['http']}/v1", api_key=key, max_retries=0, timeout=300
        ) as client:
            one = _openai_one(client, max_tokens)
            await one()
            yield one
    elif side == "curl":
        yield _curl_one(addresses["http"], key, max_tokens)
    else:
        raise ValueError(f"unknown side {side!r}")


def vllm_request(ids: list[int], max_tokens: int) -> vllm_pb.GenerateRequest:
    """The engine side's request as VllmEngine's ``Generate``: the prompt's ids, greedy
    (as the gateway sends greedy to VllmEngine), ``max_tokens`` tokens, ignore_eos,
    streamed."""
    return vllm_pb.GenerateRequest(
        request_id=f"bench-{secrets.token_hex(8)}",
        tokenized=vllm_pb.TokenizedInput(input_ids=ids),
        sampling_params=vllm_pb.SamplingParams(
            temperature=0.0,
            top_p=1.0,
            repetition_penalty=1.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            n=1,
        ),
        stream=True,
    )


async def vllm_chunks(call: Any) -> AsyncIterator[Any]:
    """VllmEngine's stream chunks (each with ``token_ids``). The closing
    GenerateComplete repeats the last delta's tokens, so it is not counted."""
    async for resp in call:
        if resp.WhichOneof("response") == "chunk":
            yield resp.chunk


def _grpc_one(
    side: str,
    channel: grpc.aio.Channel,
    key: str,
    ids: list[int],
    max_tokens: int,
    protocol: str = "llm",
) -> OneRequest:
    engine = engine_pb2_grpc.EngineStub(channel)
    gateway = gateway_pb2_grpc.GatewayStub(channel)
    vllm = vllm_grpc.VllmEngineStub(channel)

    async def one() -> Sample:
        if side == "engine" and protocol == "vllm":
            call = vllm.Generate(vllm_request(ids, max_tokens), timeout=300)
            return await timed_stream(vllm_chunks(call))
        if side == "engine":
            req = engine_pb2.EngineGenerateRequest(
                request_id=f"bench-{secrets.token_hex(8)}",
                prompt_token_ids=ids,
                sampling=engine_pb2.EngineSamplingParams(max_tokens=max_tokens, ignore_eos=True),
            )
            return await timed_stream(engine.Generate(req, timeout=300))
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        greq = gateway_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling)
        md = (("authorization", f"Bearer {key}"),)
        return await timed_stream(gateway.Generate(greq, metadata=md, timeout=300))

    return one


def completions_body(max_tokens: int, model: str = "") -> dict[str, Any]:
    """The HTTP sides' request: the gateway side's, as ``POST /v1/completions``
    (``model``: the name the front lists; the gateway takes "" for its default)."""
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }


def _aiohttp_one(session: Any, base_url: str, key: str, body: dict[str, Any]) -> OneRequest:
    headers = {"Authorization": f"Bearer {key}"}

    async def one() -> Sample:
        t0 = time.perf_counter()
        stamps: list[float] = []
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {") and _text_of(line[6:]):
                    stamps.append(time.perf_counter())
        return sample(t0, stamps, stamps)

    return one


def _text_of(data: bytes) -> str:
    choices = json.loads(data).get("choices") or [{}]
    return str(choices[0].get("text") or "")


def _curl_one(base_url: str, key: str, max_tokens: int) -> OneRequest:
    """curl's own clock from the start of the transfer to the first response byte,
    which the HTTP front sends with the first text event (its headers go out with
    it). Curl reports no inter-event times, so both gap figures are NaN."""
    body = json.dumps(completions_body(max_tokens))

    async def one() -> Sample:
        proc = await asyncio.create_subprocess_exec(
            "curl",
            "-sN",
            "-o",
            "/dev/null",
            "-w",
            "%{time_starttransfer}",
            "-H",
            f"Authorization: Bearer {key}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            f"{base_url}/v1/completions",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        first = float(out.decode() or "nan")
        return first, math.nan, math.nan, first

    return one


def _openai_one(client: Any, max_tokens: int) -> OneRequest:
    async def one() -> Sample:
        t0 = time.perf_counter()
        stamps: list[float] = []
        stream = await client.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=max_tokens,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        async for event in stream:
            if event.choices and event.choices[0].text:
                stamps.append(time.perf_counter())
        return sample(t0, stamps, stamps)

    return one
