"""Stream a completion straight from an engine replica (for ops and debugging).

    llm-engine-client [--address 127.0.0.1:50071] [--tokenizer 127.0.0.1:50061]
                      [--max-tokens 64] [--temperature 0] "prompt"

The prompt is sent as a chat message through the tokenizer service's chat
template; tokens are detokenized incrementally as they arrive. The gateway
(once running) is the way teams call the stack; this talks to one engine.
Engines and tokenizers that require the internal-call secret get it from
``--service-token-file`` (default: ``make run``'s ``.run/service.token``).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Sequence

import grpc

from common.service_auth import default_token_file, read_service_token, token_metadata
from llm.v1 import common_pb2, engine_pb2, engine_pb2_grpc, tokenizer_pb2, tokenizer_pb2_grpc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="llm-engine-client", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--address", default="127.0.0.1:50071")
    p.add_argument("--tokenizer", default="127.0.0.1:50061")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--service-token-file",
        default=default_token_file(),
        help="the internal-call secret (default: make run's, when present)",
    )
    args = p.parse_args(argv)
    md = token_metadata(read_service_token(args.service_token_file))
    with grpc.insecure_channel(args.tokenizer) as tch, grpc.insecure_channel(args.address) as ech:
        tok = tokenizer_pb2_grpc.TokenizerStub(tch)
        eng = engine_pb2_grpc.EngineStub(ech)
        try:
            msgs = common_pb2.ChatMessages(
                messages=[common_pb2.ChatMessage(role="user", content=args.prompt)]
            )
            ids = tok.Encode(
                tokenizer_pb2.EncodeRequest(messages=msgs), timeout=10, metadata=md
            ).token_ids
            req = engine_pb2.EngineGenerateRequest(
                request_id=uuid.uuid4().hex,
                prompt_token_ids=ids,
                sampling=engine_pb2.EngineSamplingParams(
                    max_tokens=args.max_tokens, temperature=args.temperature
                ),
            )

            def token_stream() -> object:
                for chunk in eng.Generate(req, timeout=300, metadata=md):
                    if chunk.finish_reason:  # before the yield: the tokenizer ends its
                        token_stream.last = chunk  # type: ignore[attr-defined]  # stream on it
                    yield tokenizer_pb2.DecodeStreamRequest(
                        token_ids=chunk.token_ids, finish=bool(chunk.finish_reason)
                    )

            for delta in tok.DecodeStream(token_stream(), metadata=md):  # type: ignore[arg-type]
                print(delta.text, end="", flush=True)
            last = token_stream.last  # type: ignore[attr-defined]
            print(
                f"\n[{common_pb2.FinishReason.Name(last.finish_reason)}] prompt "
                f"{last.usage.prompt_tokens} tokens, completion {last.usage.completion_tokens}, "
                f"ttft {last.timings.time_to_first_token_seconds * 1000:.0f} ms",
                file=sys.stderr,
            )
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
