"""Command-line client of the stack: stream completions, and admin the limits.

    llm-client chat "What is the capital of France?"
    llm-client prompt "Once upon a time" --max-tokens 64 --temperature 0.8
    llm-client --json chat "Hi"              # one JSON object per chunk
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
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.api import httpbody_pb2
from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from common.addresses import host_of, is_loopback
from common.config import ROOT
from llm.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc

RUN_DIR = Path(os.environ.get("LLM_RUN_DIR", ROOT / ".run"))


def _key(flag: str | None, env: str, file: str) -> str:
    if flag:
        return flag
    if os.environ.get(env):
        return os.environ[env]
    path = RUN_DIR / file
    if path.exists():
        return path.read_text().strip()
    raise SystemExit(
        f"error: no key: pass it as a flag, set ${env}, or run `make run` (it writes {path})"
    )


def ca_cert(args: argparse.Namespace, host: str) -> Path | None:
    """The CA to trust: the flag, $LLM_CA_CERT, make run's for loopback, else None
    (gRPC's own roots)."""
    given = args.ca_cert or os.environ.get("LLM_CA_CERT")
    if given:
        if not Path(given).is_file():
            raise SystemExit(f"error: no CA certificate at {given}")
        return Path(given)
    local = RUN_DIR / "tls" / "ca.crt"
    return local if is_loopback(host) and local.is_file() else None


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """TLS to ``--address`` (plaintext only with --plaintext, only to loopback)."""
    host = host_of(args.address)
    if args.plaintext:
        if not is_loopback(host):
            raise SystemExit(
                f"error: --plaintext only to a loopback address, not {host!r}: "
                "Envoy serves TLS (trust its CA with --ca-cert)"
            )
        return grpc.insecure_channel(args.address)
    ca = ca_cert(args, host)
    creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes() if ca else None)
    options = []
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return grpc.secure_channel(args.address, creds, options)


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
    else:
        req.prompt = args.text
    md = (("authorization", f"Bearer {_key(args.api_key, 'LLM_API_KEY', 'demo.key')}"),)
    last = None
    model = ""  # the first chunk names the model (and version) that served it
    for chunk in stub.Generate(req, metadata=md, timeout=args.timeout):
        if args.json:
            print(json_format.MessageToJson(chunk, indent=None), flush=True)
        else:
            print(chunk.text, end="", flush=True)
        model = model or chunk.model
        last = chunk
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


def update_tenant(t: admin_pb2.Tenant, a: argparse.Namespace) -> None:
    """Apply the flags that were given (None = not given) to ``t``."""
    limits = t.limits
    for flag, field in (
        ("rpm", "requests_per_minute"),
        ("tpm", "tokens_per_minute"),
        ("concurrent", "max_concurrent"),
        ("request_burst", "request_burst"),
        ("token_burst", "token_burst"),
    ):
        value = getattr(a, flag)
        if value is not None:
            setattr(limits, field, value)
    if a.priority is not None:
        t.priority = common_pb2.Priority.Value(a.priority)
    if a.share is not None:
        t.fair_share = a.share
    if a.all_models:
        del t.allowed_models[:]
    elif a.model:
        t.allowed_models[:] = a.model
    if a.shadow is not None:
        t.shadow_mode = a.shadow
    update_budgets(t, a)


BUDGET_HELP = (
    "NAME=LIMIT/PERIOD[,rolling][,tz=ZONE][,warn=PERCENT]: LIMIT in tokens, or USD with a "
    "'usd' suffix (priced by the gateway's price table); PERIOD hour, day or month (the "
    "calendar period in ZONE, default UTC, or the last hour/24 h/30 days with 'rolling'); "
    "warn: soft threshold in percent (default 80, 0 = none). Repeat for several; a name "
    "that exists is replaced"
)
_PERIODS = {"hour": "BUDGET_HOUR", "day": "BUDGET_DAY", "month": "BUDGET_MONTH"}


def parse_budget(text: str) -> admin_pb2.Budget:
    """``daily=200000/day,tz=Europe/Berlin`` -> a ``Budget`` message (see BUDGET_HELP)."""
    head, *options = text.split(",")
    name, eq, spec = head.partition("=")
    amount, slash, period = spec.partition("/")
    if not (eq and slash and name and period in _PERIODS):
        raise argparse.ArgumentTypeError(f"budget {text!r}: expected {BUDGET_HELP}")
    cost = amount.lower().endswith("usd")
    try:
        limit = float(amount[:-3] if cost else amount)
    except ValueError:
        raise argparse.ArgumentTypeError(f"budget {text!r}: {amount!r} is not a number") from None
    b = admin_pb2.Budget(
        name=name,
        metric=admin_pb2.BudgetMetric.Value("BUDGET_COST_USD" if cost else "BUDGET_TOKENS"),
        period=admin_pb2.BudgetPeriod.Value(_PERIODS[period]),
        limit=limit,
        warn_percent=80,
    )
    for option in options:
        key, _, value = option.partition("=")
        if key == "rolling" and not value:
            b.rolling = True
        elif key == "tz" and value:
            b.timezone = value
        elif key == "warn" and value.isdigit():
            b.warn_percent = int(value)
        else:
            raise argparse.ArgumentTypeError(
                f"budget {text!r}: unknown option {option!r} (rolling, tz=ZONE, warn=PERCENT)"
            )
    return b


def update_budgets(t: admin_pb2.Tenant, a: argparse.Namespace) -> None:
    """Replace or add the ``--budget`` budgets by name; drop the ``--drop-budget`` ones."""
    given = {b.name: b for b in a.budget or ()}
    drop = set(a.drop_budget or ())
    kept = [b for b in t.budgets if b.name not in given and b.name not in drop]
    del t.budgets[:]
    t.budgets.extend([*kept, *given.values()])


def version_weight(text: str) -> tuple[str, int]:
    """``v2=5`` -> ("v2", 5)."""
    version, _, weight = text.partition("=")
    if not version or not weight.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected VERSION=WEIGHT, e.g. v2=5")
    return version, int(weight)


def duration_s(text: str) -> int:
    """``90``, ``90s``, ``15m``, ``12h`` or ``30d`` -> seconds (> 0)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: use e.g. 3600, 90s, 15m, 12h or 30d"
        )
    return int(number) * units[unit]


def _expiry(seconds_from_now: int | None) -> Timestamp | None:
    if seconds_from_now is None:
        return None
    ts = Timestamp()
    ts.FromSeconds(int(time.time()) + seconds_from_now)
    return ts


def key_update(a: argparse.Namespace) -> admin_pb2.UpdateApiKeyRequest:
    """UpdateApiKey for the flags given (others unchanged)."""
    req = admin_pb2.UpdateApiKeyRequest(api_key=admin_pb2.ApiKey(key_id=a.key_id))
    for name in ("name", "owner", "description"):
        value = getattr(a, name)
        if value is not None:
            setattr(req.api_key, name, value)
            req.update_mask.paths.append(name)
    if a.budget or a.no_budgets:  # the key's whole list of budgets is replaced
        req.api_key.budgets.extend(a.budget or ())
        req.update_mask.paths.append("budgets")
    if a.expires_in is not None or a.no_expiry:
        expiry = _expiry(a.expires_in)
        if expiry is not None:
            req.api_key.expires_at.CopyFrom(expiry)
        req.update_mask.paths.append("expires_at")
    if not req.update_mask.paths:
        raise SystemExit(
            "key-update: give at least one of --name, --owner, --description, "
            "--expires-in, --no-expiry, --budget, --no-budgets"
        )
    return req


def _admin_calls(a: argparse.Namespace) -> dict[str, Callable[[Any], Message]]:
    def tenant(stub: Any) -> Message:
        """Create, or change only what the flags say: the rest of an existing tenant
        (limits, priority, models, shadow mode) is kept, not reset."""
        try:
            t = stub.GetTenant(admin_pb2.GetTenantRequest(tenant_id=a.tenant))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            t = admin_pb2.Tenant(id=a.tenant, priority=common_pb2.Priority.Value("NORMAL"))
        update_tenant(t, a)
        resp: Message = stub.UpsertTenant(t)
        return resp

    return {
        "tenants": lambda s: s.ListTenants(admin_pb2.ListTenantsRequest()),
        "tenant": tenant,
        "get": lambda s: s.GetTenant(admin_pb2.GetTenantRequest(tenant_id=a.tenant)),
        "delete": lambda s: s.DeleteTenant(admin_pb2.DeleteTenantRequest(tenant_id=a.tenant)),
        "key": lambda s: s.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(
                tenant_id=a.tenant,
                name=a.name,
                owner=a.owner or "",
                description=a.description or "",
                expires_at=_expiry(a.expires_in),
                budgets=a.budget or (),
            )
        ),
        "key-update": lambda s: s.UpdateApiKey(key_update(a)),
        "rotate": lambda s: s.RotateApiKey(
            admin_pb2.RotateApiKeyRequest(key_id=a.key_id, grace_seconds=a.grace)
        ),
        "keys": lambda s: s.ListApiKeys(admin_pb2.ListApiKeysRequest(tenant_id=a.tenant)),
        "revoke": lambda s: s.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id=a.key_id)),
        "usage": lambda s: s.GetUsage(admin_pb2.GetUsageRequest(tenant_id=a.tenant)),
        "reset": lambda s: s.ResetLimits(
            admin_pb2.ResetLimitsRequest(tenant_id=a.tenant, budgets=a.budgets)
        ),
        "audit": lambda s: s.ListAuditEvents(admin_pb2.ListAuditEventsRequest(limit=a.limit)),
        "models": lambda s: s.ListRoutingPolicies(admin_pb2.ListRoutingPoliciesRequest()),
        "routing": lambda s: s.GetRoutingPolicy(admin_pb2.GetRoutingPolicyRequest(model=a.model)),
        "rollout": lambda s: s.GetRolloutStatus(admin_pb2.GetRolloutStatusRequest(model=a.model)),
        "weights": lambda s: s.SetWeights(
            admin_pb2.SetWeightsRequest(
                model=a.model,
                weights=dict(a.weights),
                expected_revision=a.expect_revision,
                reason=a.reason,
            )
        ),
        "rollback": lambda s: s.Rollback(
            admin_pb2.RollbackRequest(
                model=a.model, to_version=a.to or "", reason=a.reason, keep_pins=a.keep_pins
            )
        ),
        "promote": lambda s: s.Promote(
            admin_pb2.PromoteRequest(model=a.model, version=a.version, reason=a.reason)
        ),
        "routes": lambda s: s.ListModelRoutes(admin_pb2.ListModelRoutesRequest()),
        "route": lambda s: s.SetModelRoute(
            admin_pb2.ModelRoute(
                name=a.name,
                targets=[
                    admin_pb2.RouteTarget(model=m, version=v)
                    for m, _, v in (t.partition("@") for t in a.targets)
                ],
                reason=a.reason,
            )
        ),
        "route-delete": lambda s: s.DeleteModelRoute(
            admin_pb2.DeleteModelRouteRequest(name=a.name)
        ),
        "usage-export": lambda s: s.ExportUsage(
            admin_pb2.QueryUsageRequest(
                tenant_id=a.tenant or "",
                key_id=a.key or "",
                model=a.model or "",
                start_date=a.start or "",
                end_date=a.end or "",
                format=a.format,
            )
        ),
    }


def admin(channel: grpc.Channel, args: argparse.Namespace) -> int:
    stubs = (
        admin_pb2_grpc.RateLimitAdminStub(channel),
        admin_pb2_grpc.RoutingAdminStub(channel),  # no method name in both services
    )
    md = (("authorization", f"Bearer {_key(args.admin_key, 'ADMIN_KEY', 'admin.key')}"),)

    class WithMetadata:  # every call carries the admin key and the timeout
        def __getattr__(self, name: str) -> Callable[[Message], Message]:
            rpc = next(getattr(s, name) for s in stubs if hasattr(s, name))
            return lambda req: rpc(req, metadata=md, timeout=args.timeout)

    resp = _admin_calls(args)[args.admin_cmd](WithMetadata())
    if isinstance(resp, httpbody_pb2.HttpBody):  # a file: as it is
        sys.stdout.write(resp.data.decode())
        return 0
    print(json.dumps(json_format.MessageToDict(resp), indent=None if args.json else 2))
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
    a = sub.add_parser("admin").add_subparsers(dest="admin_cmd", required=True)
    a.add_parser("tenants")
    t = a.add_parser(
        "tenant", help="create a tenant, or change only the given settings of an existing one"
    )
    t.add_argument("tenant")
    t.add_argument("--rpm", type=int, help="requests per minute, 0 = unlimited")
    t.add_argument("--tpm", type=int, help="tokens per minute, 0 = unlimited")
    t.add_argument("--concurrent", type=int, help="concurrent streams, 0 = unlimited")
    t.add_argument("--request-burst", type=int, help="request bucket size, 0 = a minute's")
    t.add_argument("--token-burst", type=int, help="token bucket size, 0 = a minute's")
    t.add_argument("--priority", choices=["LOW", "NORMAL", "CRITICAL"])
    t.add_argument("--share", type=int, help="fair share of the engines within its class (1-100)")
    t.add_argument("--model", action="append", help="allowed model (repeat; replaces the list)")
    t.add_argument("--all-models", action="store_true", help="allow every model again")
    t.add_argument(
        "--shadow",
        action=argparse.BooleanOptionalAction,
        help="decide and record, never deny (--no-shadow: enforce)",
    )
    t.add_argument("--budget", action="append", type=parse_budget, help=BUDGET_HELP)
    t.add_argument("--drop-budget", action="append", metavar="NAME", help="remove a budget")
    for name in ("get", "delete", "keys", "usage"):
        a.add_parser(name).add_argument("tenant")
    r = a.add_parser("reset", help="refill the tenant's buckets (leases are kept)")
    r.add_argument("tenant")
    r.add_argument(
        "--budgets", action="store_true", help="also zero what its budgets counted this period"
    )
    k = a.add_parser("key", help="create an API key (printed once)")
    k.add_argument("tenant")
    k.add_argument("--name", default="cli")
    k.add_argument("--owner", help="who holds the key (for audits)")
    k.add_argument("--description")
    k.add_argument("--expires-in", type=duration_s, help="e.g. 90d, 12h (default: never)")
    k.add_argument(
        "--budget", action="append", type=parse_budget, help="the key's own; " + BUDGET_HELP
    )
    u = a.add_parser("key-update", help="change a key's name, owner, description or expiry")
    u.add_argument("key_id")
    u.add_argument("--name")
    u.add_argument("--owner")
    u.add_argument("--description")
    exp = u.add_mutually_exclusive_group()
    exp.add_argument("--expires-in", type=duration_s, help="expire this long from now")
    exp.add_argument("--no-expiry", action="store_true", help="never expire")
    kb = u.add_mutually_exclusive_group()
    kb.add_argument(
        "--budget",
        action="append",
        type=parse_budget,
        help="replaces the key's budgets with the ones given; " + BUDGET_HELP,
    )
    kb.add_argument("--no-budgets", action="store_true", help="drop the key's own budgets")
    r = a.add_parser("rotate", help="issue a replacement key; the old one works for --grace")
    r.add_argument("key_id")
    r.add_argument("--grace", type=duration_s, default=3600, help="e.g. 1h (default), 7d")
    a.add_parser("models", help="routing policies of every model")
    for name in ("routing", "rollout"):
        a.add_parser(name, help=f"a model's {name} (policy / per-version figures)").add_argument(
            "model"
        )
    w = a.add_parser("weights", help="shift traffic between versions, e.g. v1=95 v2=5")
    w.add_argument("model")
    w.add_argument("weights", nargs="+", type=version_weight, metavar="VERSION=WEIGHT")
    w.add_argument("--expect-revision", type=int, default=0, help="compare-and-set")
    rb = a.add_parser("rollback", help="all weight back to the stable version (or --to)")
    rb.add_argument("model")
    rb.add_argument("--to", metavar="VERSION")
    rb.add_argument("--keep-pins", action="store_true", help="keep tenant pins to candidates")
    pr = a.add_parser("promote", help="make a version the stable one with all the weight")
    pr.add_argument("model")
    pr.add_argument("version")
    a.add_parser("routes", help="model routes (aliases and fallback chains)")
    ro = a.add_parser(
        "route", help="set a model route: NAME -> targets tried in order (MODEL or MODEL@VERSION)"
    )
    ro.add_argument("name")
    ro.add_argument("targets", nargs="+", metavar="MODEL[@VERSION]")
    a.add_parser("route-delete", help="remove a model route").add_argument("name")
    for cmd in (w, rb, pr, ro):
        cmd.add_argument("--reason", default="", help="why (goes to the audit log)")
    x = a.add_parser(
        "usage-export",
        help="usage records per day, tenant, key, model and version (CSV or JSON on stdout)",
    )
    x.add_argument("--tenant", help="one tenant (default: all, deleted ones included)")
    x.add_argument("--key", help="one key id")
    x.add_argument("--model")
    x.add_argument("--from", dest="start", metavar="YYYY-MM-DD", help="default: 29 days back")
    x.add_argument("--to", dest="end", metavar="YYYY-MM-DD", help="default: today (UTC)")
    x.add_argument("--format", choices=["csv", "json"], default="csv")
    a.add_parser("revoke").add_argument("key_id")
    a.add_parser("audit").add_argument("--limit", type=int, default=20)
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
