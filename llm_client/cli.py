"""Command-line client of the stack: stream completions, and admin the limits.

    llm-client chat "What is the capital of France?"
    llm-client prompt "Once upon a time" --max-tokens 64 --temperature 0.8
    llm-client --json chat "Hi"              # one JSON object per chunk
    llm-client chat "A city as JSON" --json-schema city.schema.json   # or --regex RE
    llm-client chat "Weather in Paris?" --tool weather.json --tool-choice required
    llm-client admin tenants                 # list
    llm-client admin tenant team-a --rpm 60 --tpm 50000 --concurrent 4 \\
        --priority CRITICAL                                # create
    llm-client admin tenant team-a --priority LOW     # change only the priority
    llm-client admin tenant team-a --budget daily=200000/day,tz=Europe/Berlin \
        --budget spend=25usd/month,warn=90 --budget hourly=20000/hour,rolling
    llm-client admin tenant team-a --drop-budget hourly
    llm-client admin reset team-a --budgets  # refill buckets and zero budget spending
    llm-client admin key team-a              # new key (shown once)
    llm-client admin key team-a --owner alice --expires-in 90d
    llm-client admin rotate KEY_ID --grace 1d     # new key; the old one works one more day
    llm-client admin key-update KEY_ID --owner bob --no-expiry
    llm-client admin keys team-a | revoke KEY_ID | usage team-a | reset team-a
    llm-client admin delete team-a | audit
    llm-client admin usage-export --from 2026-11-01 --to 2026-11-30 > usage.csv
    llm-client admin models | routing MODEL | rollout MODEL     # versions and canaries
    llm-client admin weights MODEL v1=95 v2=5 --reason "canary 5%"
    llm-client admin rollback MODEL --reason "errors" | promote MODEL v2
    llm-client admin route team-chat SmolLM2-135M-Instruct          # an alias
    llm-client admin route big-model big-model small-model          # a fallback chain
    llm-client admin routes | route-delete team-chat

Talks to Envoy (127.0.0.1:8080) unless --address says otherwise, over TLS:
the server's certificate is checked against --ca-cert, $LLM_CA_CERT, make
run's local CA (.run/tls/ca.crt, for a loopback address) or the system's
roots, in that order. --plaintext (no TLS) is for loopback addresses only.
The API key comes from --api-key, $LLM_API_KEY or .run/demo.key; the admin
key from --admin-key, $ADMIN_KEY or .run/admin.key. Errors print one line
with the gRPC status and exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from google.protobuf import json_format

from llm.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from llm_client.admin import admin
from llm_client.admin_args import add_admin_parser
from llm_client.structured import CallPrinter, add_args, apply
from llm_client.transport import open_channel, read_key


def _sampling(args: argparse.Namespace) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop or [],
    )
    if args.seed is not None:
        sp.seed = args.seed
    return sp


def generate(channel: grpc.Channel, args: argparse.Namespace) -> int:
    stub = gateway_pb2_grpc.GatewayStub(channel)
    req = gateway_pb2.GenerateRequest(model=args.model, sampling=_sampling(args))
    if args.cmd == "chat":
        msgs = [common_pb2.ChatMessage(role="user", content=args.text)]
        if args.system:
            msgs.insert(0, common_pb2.ChatMessage(role="system", content=args.system))
        req.messages.CopyFrom(common_pb2.ChatMessages(messages=msgs))
        apply(req, args)
    else:
        req.prompt = args.text
    md = (("authorization", f"Bearer {read_key(args.api_key, 'LLM_API_KEY', 'demo.key')}"),)
    last = None
    model = ""  # the first chunk names the model (and version) that served it
    calls = CallPrinter()
    for chunk in stub.Generate(req, metadata=md, timeout=args.timeout):
        if args.json:
            print(json_format.MessageToJson(chunk, indent=None), flush=True)
        else:
            if chunk.reasoning_text:
                print(chunk.reasoning_text, end="", file=sys.stderr, flush=True)
            print(chunk.text, end="", flush=True)
        calls.add(chunk)
        model = model or chunk.model
        last = chunk
    if not args.json:
        for line in calls.lines():
            print(f"\n{line}", end="", flush=True)
    if last is not None and not args.json:
        u = last.usage
        reason = common_pb2.FinishReason.Name(last.finish_reason)
        print(
            f"\n[{reason}] model {model} request {last.request_id}: prompt "
            f"{u.prompt_tokens} tokens ({u.cached_prompt_tokens} cached), "
            f"completion {u.completion_tokens}",
            file=sys.stderr,
        )
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llm-client", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--address", default=os.environ.get("LLM_ADDRESS", "127.0.0.1:8080"))
    p.add_argument(
        "--ca-cert",
        metavar="PEM",
        help="CA that signed the server's certificate (default: $LLM_CA_CERT, else make "
        "run's .run/tls/ca.crt for a loopback address, else the system's roots)",
    )
    p.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name to check in the certificate, when --address does not carry it",
    )
    p.add_argument("--plaintext", action="store_true", help="no TLS (only to a loopback address)")
    p.add_argument("--api-key")
    p.add_argument("--admin-key")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=300.0)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("chat", "prompt"):
        g = sub.add_parser(name)
        g.add_argument("text")
        g.add_argument("--model", default="")
        g.add_argument("--max-tokens", type=int, default=128)
        g.add_argument("--temperature", type=float, default=0.0)
        g.add_argument("--top-p", type=float, default=0.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--seed", type=int)
        g.add_argument("--stop", action="append")
        if name == "chat":
            g.add_argument("--system")
            add_args(g)
    add_admin_parser(sub.add_parser("admin"))
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with open_channel(args) as channel:
        try:
            return admin(channel, args) if args.cmd == "admin" else generate(channel, args)
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
            print(f"\nerror: {code.name}: {e.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    raise SystemExit(main())
