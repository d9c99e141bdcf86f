"""bench.gatewaylib.stock, .smg and the stock sides of .sides, .measure, .report and
.plot: the VllmEngine side over a real grpc.aio server, the smg side over a real
HTTP server, SMG's command line and readiness, and what the report makes of the
seven sides (engine, floor, work, gateway, http, smg, smg-tenant)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import math
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from aiohttp import web
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from bench.gatewaylib import measure as measure_mod
from bench.gatewaylib import stock
from bench.gatewaylib.limits import BENCH_LIMITS
from bench.gatewaylib.placement import CpuSplit
from bench.gatewaylib.plot import plot
from bench.gatewaylib.report import build_report, headline, headline_table, print_summary
from bench.gatewaylib.sides import PROMPT, OneRequest, Sample, side_client, vllm_request
from bench.gatewaylib.smg import SmgTenant, models_listed, smg_command
from bench.gatewaylib.stats import net_cpu_ms
from bench.gatewaylib.stock import STOCK_SIDES, StubTiming, cpu_owner
from tests.unit.bench.fakes import bench_args

# to the first token (s): what each stock side's fake answers with; HTTP sides' first
# token is their first text event
STOCK_TTFT = {
    "engine": 0.100,
    "floor": 0.101,
    "work": 0.1015,
    "gateway": 0.102,
    "http": 0.104,
    "smg": 0.107,
    "smg-tenant": 0.108,
}


class FakeVllm(pb_grpc.VllmEngineServicer):  # type: ignore[misc]
    """Generate as the stock servicer streams: one chunk per token, then a
    GenerateComplete that repeats the last delta."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> AsyncIterator[Any]:
        self.requests.append(request)
        for i in range(request.sampling_params.max_tokens):
            yield pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[100 + i]))
        last = request.sampling_params.max_tokens + 99
        yield pb.GenerateResponse(
            complete=pb.GenerateComplete(output_ids=[last], finish_reason="length")
        )


def test_the_engine_side_speaks_vllm_engine_and_counts_chunks_only() -> None:
    servicer = FakeVllm()

    async def run() -> list[Sample]:
        server = grpc.aio.server()
        pb_grpc.add_VllmEngineServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            addresses = {"engine": f"127.0.0.1:{port}", "engine_protocol": "vllm"}
            async with side_client("engine", addresses, "k", [5, 6, 7], 4) as one:
                return [await one(), await one()]
        finally:
            await server.stop(None)

    samples = asyncio.run(run())
    assert len(servicer.requests) == 2  # one channel: no untimed opening request
    req = servicer.requests[-1]
    assert list(req.tokenized.input_ids) == [5, 6, 7]
    assert (req.sampling_params.max_tokens, req.sampling_params.ignore_eos) == (4, True)
    assert req.sampling_params.temperature == 0.0
    assert req.stream
    assert len({r.request_id for r in servicer.requests}) == 2
    for ttft, itl, _gap, first_text in samples:
        assert 0 < ttft == first_text  # the engine's chunks carry no text: tokens stand in
        assert itl >= 0


def test_vllm_request_is_greedy_and_streamed() -> None:
    req = vllm_request([1, 2], 9)
    p = req.sampling_params
    assert (p.top_p, p.repetition_penalty, p.n, p.top_k) == (1.0, 1.0, 1, 0)
    assert (p.max_tokens, p.ignore_eos, req.stream) == (9, True, True)
    assert req.request_id.startswith("bench-")
    assert vllm_request([1], 1).request_id != req.request_id


def test_the_smg_side_posts_the_http_request_with_smgs_model_name() -> None:
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("", "The", " sea"):
            event = {"choices": [{"text": text, "index": 0}]}
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def run() -> Sample:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            addresses = {"smg": f"http://127.0.0.1:{port}", "smg_model": "SmolLM2"}
            async with side_client("smg", addresses, "k", [1], 3) as one:
                return await one()
        finally:
            await runner.cleanup()

    ttft, _itl, gap, first_text = asyncio.run(run())
    assert bodies[-1]["model"] == "SmolLM2"
    assert bodies[-1]["prompt"] == PROMPT
    assert (bodies[-1]["max_tokens"], bodies[-1]["stream"], bodies[-1]["ignore_eos"]) == (
        3,
        True,
        True,
    )
    assert bodies[-1]["temperature"] == 0
    assert 0 < ttft == first_text  # the first event with text, not the empty one
    assert gap >= 0


def test_smg_command_names_the_workers_model_and_its_own_ports() -> None:
    cmd = smg_command(
        ["grpc://127.0.0.1:5"], Path("/m/SmolLM2"), 8001, 8002, smg=Path("/v/bin/smg")
    )
    assert cmd[:2] == ["/v/bin/smg", "launch"]
    flags = dict(zip(cmd[2::2], cmd[3::2], strict=True))
    assert flags == {
        "--worker-urls": "grpc://127.0.0.1:5",
        "--model-path": "/m/SmolLM2",
        "--host": "127.0.0.1",
        "--port": "8001",
        "--prometheus-host": "127.0.0.1",
        "--prometheus-port": "8002",
        "--log-level": "warn",
    }


def test_an_smg_tenant_is_its_key_and_its_buckets_with_every_other_tenant_starved(
    tmp_path: Path,
) -> None:
    tenant = SmgTenant(tokens_per_minute=500, requests_per_minute=7)
    other = SmgTenant(500, 7)
    assert tenant.key.startswith("sk-smg-")
    assert tenant.key != other.key  # fresh per run
    policy = tmp_path / "p.yaml"
    args = tenant.args(policy)
    assert args[:2] == ["--tenant-api-key", f"bench:{tenant.key}"]
    assert args[2:] == ["--tenant-rate-limit-enabled", "--tenant-rate-limit-config", str(policy)]
    doc = yaml.safe_load(tenant.policy_yaml())
    assert doc["tenants"] == [
        {"tenant_key": "auth:bench", "tokens_per_minute": 500, "requests_per_minute": 7}
    ]
    assert doc["default_policy"] == {"tokens_per_minute": 1, "requests_per_minute": 1}
    # no limits (--unlimited-tenant): SMG checks the key and keeps no buckets
    key_only = SmgTenant(0, 0)
    assert not key_only.limited
    assert key_only.args(policy) == ["--tenant-api-key", f"bench:{key_only.key}"]


@contextlib.contextmanager
def models_server(payload: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_smg_is_ready_once_it_lists_a_model() -> None:
    with models_server(b'{"object":"list","data":[{"id":"SmolLM2"}]}') as url:
        assert models_listed(url)
    with models_server(b'{"object":"list","data":[]}') as url:
        assert not models_listed(url)
    assert not models_listed(url)  # nothing listens there any more


def test_each_sides_cpu_is_the_proxy_in_front_of_the_engine() -> None:
    owners = [cpu_owner(s) for s in STOCK_SIDES]
    assert owners == ["gateway", "floor", "work", "gateway", "gateway", "smg", "smg-tenant"]


class FakeService:
    """A started service as ``Stack.service`` returns it: its address and process."""

    def __init__(self, port: int) -> None:
        self.address = f"127.0.0.1:{port}"
        self.proc = type("P", (), {"pid": port})()


def test_the_stub_engine_speaks_vllm_engine_to_the_gateway_the_relay_and_smg(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """stub-vllm: the stub engine is the stack's first service (stopped last), held at
    the asked pace, and the gateway (as vllm://), the bare relay (VllmEngine) and SMG
    (grpc://) all front its address; the stock server is not started."""
    events: list[Any] = []
    tenants: list[Any] = []

    class FakeStack:
        def __init__(self, spec: Any) -> None:
            self.spec = spec
            self.engines: list[str] = []
            self.procs: dict[str, FakeService] = {}
            self.gateway, self.http, self.admin_key = "127.0.0.1:2", "http://127.0.0.1:3", "a"

        def service(self, name: str, module: str, args: list[str], *rest: Any, **kw: Any) -> Any:
            events.append(("service", name, module, args, rest))
            self.procs[name] = FakeService(10 + len(self.procs))
            return self.procs[name]

        def start(self) -> Any:
            events.append(("start", list(self.engines)))
            self.procs["bench-gateway"] = FakeService(2)
            return self

        def metrics_url(self, name: str) -> str:
            return f"http://{name}/metrics"

        def stop(self) -> None:
            events.append("stack stopped")

    class FakeSmg:
        def __init__(self, urls: list[str], model_dir: Path, log_dir: Path, **kw: Any) -> None:
            self.name, self.tenant = kw.get("name", "smg"), kw.get("tenant")
            tenants.append(self.tenant)
            events.append((self.name, urls))
            pid = 40 if self.tenant is None else 41
            self.proc, self.url = FakeService(pid).proc, f"http://{self.name}"
            self.command = ["smg", "x"]

        def start(self) -> None:
            events.append(f"{self.name} started")

        def stop(self) -> None:
            events.append(f"{self.name} stopped")

    def no_stock_server(*_: Any, **__: Any) -> None:
        raise AssertionError("stub-vllm started the stock vLLM server")

    monkeypatch.setattr(stock, "Stack", FakeStack)
    monkeypatch.setattr(stock, "SmgProcess", FakeSmg)
    monkeypatch.setattr(stock, "StockVllm", no_stock_server)
    with stock.stock_stack(tmp_path, stub=StubTiming(100.0, 20.0)) as run:
        engine = run.addresses["engine"]
        assert (engine, run.addresses["engine_protocol"]) == ("127.0.0.1:10", "vllm")
        assert run.facts["stub_first_token_ms"] == 100.0
        assert run.facts["stub_token_gap_ms"] == 20.0
        assert run.proxies == {"gateway": 2, "smg": 40, "floor": 12, "work": 13, "smg-tenant": 41}
        # the second SMG takes the bench tenant's key of its own, which the side sends
        key = run.addresses["smg-tenant_key"]
        assert key.startswith("sk-smg-")
        assert run.addresses["smg-tenant"] == "http://smg-tenant"
    plain, tenant = tenants
    assert plain is None  # the first SMG checks nothing
    assert tenant.key == key  # the second takes the key the side sends, with the bench limits
    limits = (tenant.tokens_per_minute, tenant.requests_per_minute)
    assert limits == (BENCH_LIMITS.tokens_per_minute, BENCH_LIMITS.requests_per_minute)
    (_, name, module, args, rest), started = events[0], events[1]
    assert (name, module) == ("bench-engine-0", "bench.gatewaylib.stub_engine")
    assert args[-2:] == ["--max-num-seqs", "32"]
    env = rest[0]
    assert (env["STUB_FIRST_TOKEN_MS"], env["STUB_TOKEN_GAP_MS"]) == ("100.0", "20.0")
    assert started == ("start", [f"vllm://{engine}"])
    floor = events[2]
    assert floor[1:3] == ("floor", "bench.gatewaylib.relay_floor")
    assert floor[3][:2] == ["--engine", engine]
    assert floor[3][-2:] == ["--engine-protocol", "vllm"]
    work = events[3]  # the same relay, encoding and detokenizing as SMG does
    assert work[1:4] == ("floor-work", "bench.gatewaylib.relay_floor", [*floor[3], "--work"])
    assert events[4] == ("smg", [f"grpc://{engine}"])
    assert events[6] == ("smg-tenant", [f"grpc://{engine}"])
    # last started, first stopped; the engine with the stack, last
    assert events[-3:] == ["smg-tenant stopped", "smg stopped", "stack stopped"]


@contextlib.asynccontextmanager
async def stock_fake_client(side: str, *_: Any, **__: Any) -> AsyncIterator[OneRequest]:
    async def one() -> Sample:
        t = STOCK_TTFT[side]
        return t, 0.010, 0.010, t

    yield one


@pytest.fixture
def stock_results(monkeypatch: pytest.MonkeyPatch, fake_sides: list[str]) -> dict[str, Any]:
    """measure() over the six stock sides, each answering with STOCK_TTFT."""
    monkeypatch.setattr(measure_mod, "side_client", stock_fake_client)
    # this process stands in for both proxies: its CPU is real, so every run records it
    me = os.getpid()
    return measure_mod.measure(
        bench_args(),
        {"gateway_metrics": "u"},
        "sk",
        [1],
        dict.fromkeys(STOCK_SIDES, me),
        STOCK_SIDES,
        {"gateway": me},
    )


def test_net_cpu_takes_the_proxys_background_rate_off_each_round() -> None:
    # round 1: 0.5 s of background in 1 s of engine-side run; the side ran 2 s and used
    # 1.5 s over 10 requests -> (1.5 - 1.0) / 10 = 50 ms; round 2: (0.9 - 0.1) / 10 = 80
    base = [
        {"gateway_cpu_s": 0.5, "run_s": 1.0, "requests": 10},
        {"gateway_cpu_s": 0.1, "run_s": 1.0, "requests": 10},
    ]
    side = [
        {"gateway_cpu_s": 1.5, "run_s": 2.0, "requests": 10},
        {"gateway_cpu_s": 0.9, "run_s": 1.0, "requests": 10},
    ]
    assert net_cpu_ms(side, base, "gateway") == pytest.approx(65.0)  # median of 50 and 80
    assert math.isnan(net_cpu_ms(side, base, "smg"))  # not recorded


def test_measure_reads_what_each_front_adds_over_the_engine(
    stock_results: dict[str, Any],
) -> None:
    for conc in ("c1", "c32"):
        res = stock_results[conc]
        assert list(res["by_round"]) == STOCK_SIDES
        added = res["added_vs_engine"]
        assert set(added) == {"floor", "work", "gateway", "http", "smg", "smg-tenant"}
        assert added["floor"]["ttft_p50_ms"] == pytest.approx(1.0)
        assert added["work"]["ttft_p50_ms"] == pytest.approx(1.5)
        assert res["work_vs_floor"]["ttft_p50_ms"] == pytest.approx(0.5)
        assert added["gateway"]["ttft_p50_ms"] == pytest.approx(2.0)
        assert added["http"]["ttft_p50_ms"] == pytest.approx(4.0)
        assert added["smg"]["ttft_p50_ms"] == pytest.approx(7.0)
        assert added["smg"]["itl_p50_ms"] == pytest.approx(0.0)
        assert res["floor_added"]["ttft_p50_ms"] == pytest.approx(1.0)
        assert res["gateway_vs_floor"]["ttft_p50_ms"] == pytest.approx(1.0)
        row = res["by_round"]["smg"][0]
        assert row["requests"] == (3 if conc == "c1" else 4)
        assert row["run_s"] > 0
        assert row["gateway_cpu_s"] >= 0
        # every side charged to the one proxy: each has a net figure, the engine none
        assert set(res["net_cpu_ms_per_request"]) == set(STOCK_SIDES) - {"engine"}
        assert all(math.isfinite(v) for v in res["net_cpu_ms_per_request"].values())
        assert res["http_vs_grpc"]["first_text_p50_ms"] == pytest.approx(2.0)
        assert res["smg_vs_http"]["ttft_p50_ms"] == pytest.approx(3.0)
        assert res["smg_tenant_vs_http"]["ttft_p50_ms"] == pytest.approx(4.0)
    paired = stock_results["c1_paired"]
    assert paired["floor_minus_engine_ttft"]["floor"]["p50_ms"] == pytest.approx(1.0)
    assert paired["work_minus_floor_ttft"]["work"]["p50_ms"] == pytest.approx(0.5)
    assert paired["minus_engine_ttft"]["smg"]["p50_ms"] == pytest.approx(7.0)
    assert set(paired["front_minus_grpc_first_text"]) == {"http", "smg", "smg-tenant"}


def test_the_headline_holds_ttft_added_and_cpu_per_side(stock_results: dict[str, Any]) -> None:
    head = headline(stock_results)
    assert list(head) == ["c1", "c32"]
    assert list(head["c32"]) == STOCK_SIDES
    assert head["c1"]["engine"]["added_ttft_p50_ms"] == 0.0
    assert head["c1"]["smg"]["ttft_p50_ms"] == pytest.approx(107.0)
    assert head["c32"]["http"]["added_ttft_p50_ms"] == pytest.approx(4.0)
    assert head["c1"]["engine"]["net_cpu_ms_per_request"] == 0.0
    net = stock_results["c1"]["net_cpu_ms_per_request"]["smg"]
    assert head["c1"]["smg"]["net_cpu_ms_per_request"] == net
    table = headline_table(head, {"smg": "SMG"}).splitlines()
    assert table[0].split()[:3] == ["conc", "side", "TTFT"]
    smg_row = next(row for row in table if row.startswith("c32   smg"))
    assert smg_row.split()[2:4] == ["107.00", "7.00"]
    assert len(smg_row.split()) == 8  # conc side ttft added cpu net ms/rank owner
    assert head["c32"]["smg"]["ttft_per_rank_ms"] == pytest.approx(0.0)  # one TTFT each
    assert math.isnan(head["c1"]["smg"]["ttft_per_rank_ms"])  # no burst at 1
    assert smg_row.endswith("SMG")
    assert len(table) == 1 + 2 * len(STOCK_SIDES)


def test_the_stock_report_summary_and_figure(
    stock_results: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    facts = {"engine_dtype": "bfloat16", "smg_command": "smg launch ..."}
    args = bench_args(engine="stock-vllm", engine_dtype="bfloat16")
    report = build_report(args, CpuSplit(None, {1}, {0}), 12, (1.0, 1.0, 1.0), stock_results, facts)
    assert report["sides"] == STOCK_SIDES
    assert report["smg_command"] == "smg launch ..."
    assert report["headline"]["c1"]["smg"]["added_ttft_p50_ms"] == pytest.approx(7.0)
    print_summary(stock_results, {s: "SMG" if s == "smg" else "gateway" for s in STOCK_SIDES})
    out = capsys.readouterr().out
    assert "side - engine, first token (text event over HTTP) [smg]: p1 7.00" in out
    assert "headline (median over rounds; added = side - engine, paired per round):" in out
    assert "bare relay" not in out.split("headline")[-1]
    report["machine"]["loadavg_at_save"] = [1.0]
    path = tmp_path / "stock.png"
    plot(report, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_headline_bars_name_the_net_cpu_where_recorded() -> None:
    from bench.gatewaylib.plot import _cpu_label

    assert _cpu_label({"cpu_ms_per_request": 5.0, "net_cpu_ms_per_request": 1.25}) == (
        "1.2 net cpu-ms"
    )
    assert _cpu_label({"cpu_ms_per_request": 5.0, "net_cpu_ms_per_request": math.nan}) == (
        "5.0 cpu-ms"
    )
    assert _cpu_label({"cpu_ms_per_request": 5.0}) == "5.0 cpu-ms"
