"""The command line of ``llm-client admin``: its sub-commands and flag parsers."""

from __future__ import annotations

import argparse

from llm.v1 import admin_pb2

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


def add_admin_parser(parser: argparse.ArgumentParser) -> None:
    """The ``admin`` command's sub-commands and their flags, on ``parser``."""
    a = parser.add_subparsers(dest="admin_cmd", required=True)
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
    t.add_argument(
        "--cache-group",
        metavar="GROUP",
        help="share prefix-cache blocks with the tenants naming the same group "
        "('' = its own cache, shared with no other tenant)",
    )
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
