"""`make run`'s supervisor: starts the stack, bootstraps keys, Ctrl-C stops everything."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import ROOT
from common.redis_server import free_port
from llm.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from tests.conftest import ENGINE_TEST_ENV
from tests.unit.deploy.helpers import OPENSSL_WHY, require_tool

pytestmark = pytest.mark.integration
SECOND = "smol-second"


def banner_example(
    banner: str, env: dict[str, str], marker: str
) -> subprocess.CompletedProcess[str]:
    """Run the example line of make run's banner that contains ``marker``, as printed."""
    line = next(ln for ln in banner.splitlines() if marker in ln)
    return subprocess.run(
        ["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def stack_env(run_dir: Path) -> dict[str, str]:
    """make run's environment for a test: its files in ``run_dir``, every port free."""
    env = {
        **os.environ,
        **ENGINE_TEST_ENV,
        "PYTHONPATH": str(ROOT),
        "LLM_RUN_DIR": str(run_dir),
        "LLM_RATELIMIT_REDIS_URL": "redis://127.0.0.1:0/0",
    }
    env.pop("ADMIN_KEY", None)
    for svc in ("TOKENIZER", "ENGINE", "GATEWAY"):
        env[f"LLM_{svc}_PORT"] = env[f"LLM_{svc}_METRICS_PORT"] = "0"
    env["LLM_ENVOY_PORT"] = env["LLM_ENVOY_ADMIN_PORT"] = "0"
    env["LLM_GATEWAY_HTTP_PORT"] = str(free_port())
    env["LLM_ENVOY_HOST"] = "127.0.0.1"
    return env


def start_stack(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """``python -m scripts.run_stack ARGS`` (what make run starts) and its banner, read
    until the stack is up (or the process ends)."""
    require_tool("openssl", OPENSSL_WHY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "scripts.run_stack", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Ctrl-C stops everything" in line:
            break
    return proc, "".join(lines)


def stop_stack(proc: subprocess.Popen[str]) -> None:
    """After a failure: let make run stop its services first, kill it only after that."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()  # its children would be orphaned: only after the grace
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_run_stack_serves_then_stops_everything_on_ctrl_c(tmp_path: Path) -> None:
    env = stack_env(tmp_path)
    env["LLM_RUN_SECOND_MODEL"] = SECOND  # make run SECOND_MODEL=...: a second engine
    proc, out = start_stack([], env)
    try:
        addr = dict(
            re.findall(r"^\s+(tokenizer|gateway|envoy)\s+(?:grpc )?(127\.0\.0\.1:\d+)", out, re.M)
        )
        assert set(addr) == {"tokenizer", "gateway", "envoy"}, out
        token = (tmp_path / "service.token").read_text().strip()
        assert len(token) >= 32
        assert (tmp_path / "service.token").stat().st_mode & 0o077 == 0
        redis_url = re.search(r"^\s+redis\s+(redis://\S+)", out, re.M)
        assert redis_url is not None, out
        redis_password = (tmp_path / "redis.password").read_text().strip()
        assert (tmp_path / "redis.password").stat().st_mode & 0o077 == 0
        anonymous = redis.Redis.from_url(redis_url.group(1))
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.get("rl:x")  # Redis answers nobody but the gateway's ACL user
        service = redis.Redis.from_url(redis_url.group(1), username="llm", password=redis_password)
        with pytest.raises(redis.exceptions.NoPermissionError):
            service.flushall()
        anonymous.close()
        service.close()
        with grpc.insecure_channel(addr["tokenizer"]) as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            # internal services answer only the gateway (which got the token)
            with pytest.raises(grpc.RpcError) as err:
                stub.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                stub.Encode(
                    tokenizer_pb2.EncodeRequest(text="hi"),
                    timeout=10,
                    metadata=(("x-service-token", "x" * 64),),
                )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.Encode(
                tokenizer_pb2.EncodeRequest(text="hi"),
                timeout=10,
                metadata=(("x-service-token", token),),
            ).token_ids
            engine = re.search(r"^\s+engine-0\s+grpc (127\.0\.0\.1:\d+)", out, re.M)
            assert engine is not None, out
            eng_client = subprocess.run(  # straight to the engine, with make run's token
                [
                    sys.executable,
                    "-m",
                    "engine_tools.engine_client",
                    "--address",
                    engine.group(1),
                    "--tokenizer",
                    addr["tokenizer"],
                    "--max-tokens",
                    "3",
                    "Hi",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert eng_client.returncode == 0, eng_client.stderr
            assert "completion 3" in eng_client.stderr
            tok_client = subprocess.run(  # the README's client finds make run's token itself
                [
                    sys.executable,
                    "-m",
                    "tokenizer_svc.client",
                    "--address",
                    addr["tokenizer"],
                    "encode",
                    "hi",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert tok_client.returncode == 0, tok_client.stderr
            assert tok_client.stdout.split()
            health = health_pb2_grpc.HealthStub(ch)  # probes stay open
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        admin_key = (tmp_path / "admin.key").read_text().strip()
        demo_key = (tmp_path / "demo.key").read_text().strip()
        assert admin_key.startswith("sk-llm-")
        assert demo_key.startswith("sk-llm-")
        # the edge is TLS only, with make run's certificate signed by its local CA
        ca = tmp_path / "tls" / "ca.crt"
        assert (tmp_path / "tls" / "tls.key").stat().st_mode & 0o077 == 0
        with grpc.insecure_channel(addr["envoy"]) as plain:
            with pytest.raises(grpc.RpcError) as err:
                admin_pb2_grpc.RateLimitAdminStub(plain).GetTenant(
                    admin_pb2.GetTenantRequest(tenant_id="demo"), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        creds = grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())
        with grpc.secure_channel(addr["envoy"], creds) as ch:  # through the edge
            admin = admin_pb2_grpc.RateLimitAdminStub(ch)
            tenant = admin.GetTenant(
                admin_pb2.GetTenantRequest(tenant_id="demo"),
                timeout=10,
                metadata=(("authorization", f"Bearer {admin_key}"),),
            )
            assert tenant.limits.requests_per_minute == 600
            chunks = list(
                gateway_pb2_grpc.GatewayStub(ch).Generate(
                    gateway_pb2.GenerateRequest(
                        prompt="Hello", sampling=common_pb2.SamplingParams(max_tokens=3)
                    ),
                    metadata=(("authorization", f"Bearer {demo_key}"),),
                    timeout=60,
                )
            )
            assert chunks[-1].usage.completion_tokens == 3
            # the second model name, served by its own engine, through the same gateway
            second = list(
                gateway_pb2_grpc.GatewayStub(ch).Generate(
                    gateway_pb2.GenerateRequest(
                        model=SECOND,
                        prompt="Hello",
                        sampling=common_pb2.SamplingParams(max_tokens=2),
                    ),
                    metadata=(("authorization", f"Bearer {demo_key}"),),
                    timeout=60,
                )
            )
            assert second[-1].usage.completion_tokens == 2
            assert second[0].model == SECOND
            cards = gateway_pb2_grpc.GatewayStub(ch).ListModels(
                gateway_pb2.ListModelsRequest(),
                metadata=(("authorization", f"Bearer {demo_key}"),),
                timeout=10,
            )
            assert SECOND in {c.id for c in cards.models}
            assert len(cards.models) == 2
        openai = banner_example(out, env, "from openai import")  # the SDK, over Envoy's TLS
        assert openai.returncode == 0, openai.stderr
        assert openai.stdout.strip()
        second_chat = banner_example(out, env, "chat --model")  # the second model's example
        assert second_chat.returncode == 0, second_chat.stderr
        assert "model " + SECOND in second_chat.stderr, second_chat.stderr
        usage = banner_example(out, env, "curl -s --cacert")  # admin HTTP/JSON over TLS
        assert usage.returncode == 0, usage.stderr
        assert json.loads(usage.stdout)["tenant_id"] == "demo"
        client = subprocess.run(
            [
                sys.executable,
                "-m",
                "llm_client",
                "--address",
                addr["envoy"],
                "chat",
                "Hi",
                "--max-tokens",
                "4",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr  # TLS, trusting make run's CA by itself
        assert "completion 4" in client.stderr or "[STOP]" in client.stderr
        export_cmd = [sys.executable, "-m", "llm_client", "--address", addr["envoy"]]
        export_cmd += ["admin", "usage-export", "--tenant", "demo"]
        for _ in range(50):  # usage records are written in the background, every 0.5 s
            export = subprocess.run(
                export_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
            )
            assert export.returncode == 0, export.stderr
            rows = list(csv.DictReader(io.StringIO(export.stdout)))
            if sum(int(r["requests"]) for r in rows) >= 3:
                break
            time.sleep(0.2)
        assert sum(int(r["requests"]) for r in rows) >= 3, export.stdout
        assert {r["tenant_id"] for r in rows} == {"demo"}
        pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "logs").glob("*.ports.json")]
        assert len(pids) == 4  # tokenizer, two engines, gateway
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)  # each service drains up to its grace
        assert proc.returncode == 0, out + rest
        assert "envoy stopped" in rest
        for name in ("tokenizer", "engine-0", "engine-1", "gateway"):
            assert f"{name} stopped (exit code 0)" in rest
        assert "redis stopped" in rest
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # every service is gone, none orphaned
    finally:
        stop_stack(proc)


def tiny_llama(out: Path, model_dir: Path) -> Path:
    """A Llama checkpoint of random weights (2 layers, hidden size 64) as
    ``save_pretrained`` writes it, with the prepared model's tokenizer: a user's own
    checkpoint directory, made here in a second (nothing downloaded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,  # the tokenizer's
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(model_dir / name, out / name)
    return out


def test_run_stack_refuses_a_directory_that_is_no_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scripts.run_stack import main

    (tmp_path / "config.json").write_text("{}")
    assert main(["--model", str(tmp_path)]) == 2  # before anything starts
    assert f"{tmp_path} is not a Hugging Face checkpoint directory (no tokenizer.json)" in (
        capsys.readouterr().err
    )


def test_make_run_serves_the_configured_model_dir_unless_told_another(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine_core.model_dir (here from the environment, as from config/stack.yaml) is what
    the tokenizer and the engines load under engine.model_name; MODEL= wins, named after
    its directory unless MODEL_NAME= says otherwise."""
    from scripts.run_stack import ServedModel

    monkeypatch.setenv("LLM_ENGINE_CORE_MODEL_DIR", str(model_dir))
    monkeypatch.setenv("LLM_ENGINE_MODEL_NAME", "configured")
    configured = ServedModel.resolve()
    assert configured == ServedModel(model_dir.resolve(), "configured")
    assert configured.env()["LLM_TOKENIZER_MODEL_DIR"] == str(model_dir.resolve())
    assert configured.env()["LLM_TOKENIZER_MODEL_NAME"] == "configured"
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(model_dir / name, mine / name)
    assert ServedModel.resolve(str(mine)) == ServedModel(mine, "mine")
    assert ServedModel.resolve(str(mine), "alias").env()["LLM_ENGINE_MODEL_NAME"] == "alias"


def test_run_stack_serves_your_own_checkpoint(tmp_path: Path, model_dir: Path) -> None:
    """make run MODEL=<dir>: the tokenizer and the engine load that checkpoint, served
    under the directory's name, and the banner's chat example reaches it."""
    ckpt = tiny_llama(tmp_path / "tiny-llama", model_dir)
    proc, out = start_stack(["--model", str(ckpt)], stack_env(tmp_path / "run"))
    try:
        assert f"serving 'tiny-llama' ({ckpt})" in out, out
        edge = re.search(r"^\s+envoy\s+(127\.0\.0\.1:\d+)", out, re.M)
        assert edge is not None, out
        demo_key = (tmp_path / "run" / "demo.key").read_text().strip()
        ca = (tmp_path / "run" / "tls" / "ca.crt").read_bytes()
        md = (("authorization", f"Bearer {demo_key}"),)
        with grpc.secure_channel(edge.group(1), grpc.ssl_channel_credentials(ca)) as ch:
            gateway = gateway_pb2_grpc.GatewayStub(ch)
            cards = gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=md, timeout=10)
            assert [c.id for c in cards.models] == ["tiny-llama"]
            chunks = list(
                gateway.Generate(
                    gateway_pb2.GenerateRequest(
                        prompt="Hello",
                        sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
                    ),
                    metadata=md,
                    timeout=60,
                )
            )
        assert chunks[0].model == "tiny-llama"
        assert chunks[-1].usage.completion_tokens == 3
        chat = banner_example(out, stack_env(tmp_path / "run"), " chat 'What is")
        assert chat.returncode == 0, chat.stderr
        assert "model tiny-llama" in chat.stderr, chat.stderr
    finally:
        stop_stack(proc)
