"""A small command-line client for the tokenizer service.

    python -m tokenizer_svc.client [--address HOST:PORT] encode TEXT
    python -m tokenizer_svc.client chat "user message" [--system TEXT]
    python -m tokenizer_svc.client decode ID [ID ...]

A tokenizer that requires the internal-call secret gets it from
``--service-token-file`` (default: ``make run``'s ``.run/service.token``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc

from common.service_auth import default_token_file, read_service_token, token_metadata
from llm.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenizer_svc.client", description=__doc__)
    p.add_argument("--address", default="127.0.0.1:50061")
    p.add_argument(
        "--service-token-file",
        default=default_token_file(),
        help="the internal-call secret (default: make run's, when present)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("encode").add_argument("text")
    c = sub.add_parser("chat")
    c.add_argument("text")
    c.add_argument("--system")
    sub.add_parser("decode").add_argument("ids", nargs="+", type=int)
    args = p.parse_args(argv)
    md = token_metadata(read_service_token(args.service_token_file))
    with grpc.insecure_channel(args.address) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        try:
            if args.cmd == "encode":
                r = stub.Encode(
                    tokenizer_pb2.EncodeRequest(text=args.text), timeout=10, metadata=md
                )
                print(" ".join(map(str, r.token_ids)))
            elif args.cmd == "chat":
                msgs = [common_pb2.ChatMessage(role="user", content=args.text)]
                if args.system:
                    msgs.insert(0, common_pb2.ChatMessage(role="system", content=args.system))
                r = stub.Encode(
                    tokenizer_pb2.EncodeRequest(
                        messages=common_pb2.ChatMessages(messages=msgs), return_text=True
                    ),
                    timeout=10,
                    metadata=md,
                )
                print(r.text, end="")
                print(f"-> {len(r.token_ids)} tokens: {' '.join(map(str, r.token_ids))}")
            else:
                d = stub.Decode(
                    tokenizer_pb2.DecodeRequest(token_ids=args.ids), timeout=10, metadata=md
                )
                print(d.text)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
