"""Engine and scheduler configuration: the ``engine_core`` section and its ``scheduler``
sub-section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from common.config import NOT_A_KEY, deprecated_flat_names


@dataclass(slots=True)
class SchedulerConfig:
    """Limits the scheduler enforces every step (the ``engine_core.scheduler`` section).

    Attributes:
        max_num_seqs: requests in the running batch.
        max_num_batched_tokens: new tokens per step (decodes + prefill chunks).
        max_model_len: prompt + output tokens of one request; not a config key: the
            engine sets it from ``engine_core.max_model_len`` and the model's context.
        max_waiting: waiting-queue bound beyond the running batch: add_request reports
            "queue full" when running + waiting reach max_num_seqs + max_waiting.
        long_prefill_token_threshold: cap on one request's prefill chunk per
            step so several prompts can share the budget; 0 = no cap.
        priority_aging_seconds: waiting this long raises a request by one
            priority class (LOW → NORMAL → CRITICAL …), so nothing starves.
        watermark: fraction of blocks kept free when admitting new requests, so
            running requests rarely need preemption right after an admission.
        fair_share: within a priority class, serve the tenant that has received
            the least service first (``fair_share.FairShare``); off = by arrival.
        fair_prefill_chunk: while prompts of two or more tenants wait for
            prefill, one request's prefill chunk per step is capped at this
            many tokens, so every tenant's prompt advances in every step (a
            tenant alone keeps the whole budget); 0 = no cap.
        priority_isolation: (off by default) a step that admits a request of a higher priority
            class than every running request runs that class (and above) alone:
            the lower classes' decodes and prefills wait that one step, so the
            urgent request's first token is not held behind them.
        priority_window_s: for this long after a request of some class arrives,
            prefill chunks of lower classes are capped at ``fair_prefill_chunk``
            (when set), so the step in flight when the next urgent request
            arrives is short; 0 = off (the default).
        interrupt_max_tokens: a newly arrived request that outranks every prompt of
            the step in flight (a higher class, or under fair share a tenant served no
            more than theirs while that step carries more prompt tokens than this) and
            whose whole prompt has at most this many tokens runs between two layers
            of that step, in a step of its own, and gets its first token there
            instead of after the step; a step in flight gives at most this many
            tokens to such interruptions; 0 = never.
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = field(default=8192, metadata=NOT_A_KEY)
    max_waiting: int = 1024
    long_prefill_token_threshold: int = 0
    priority_aging_seconds: float = 10.0
    watermark: float = 0.01
    fair_share: bool = True
    fair_prefill_chunk: int = 128
    priority_isolation: bool = False
    priority_window_s: float = 0.0
    interrupt_max_tokens: int = 256

    def validate(self) -> None:
        """Raises ValueError on a nonsensical limit."""
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.priority_aging_seconds <= 0:
            raise ValueError("priority_aging_seconds must be > 0")
        if self.fair_prefill_chunk < 0:
            raise ValueError(f"fair_prefill_chunk must be >= 0, got {self.fair_prefill_chunk}")
        if self.priority_window_s < 0:
            raise ValueError(f"priority_window_s must be >= 0, got {self.priority_window_s}")
        if self.interrupt_max_tokens < 0:
            raise ValueError(f"interrupt_max_tokens must be >= 0, got {self.interrupt_max_tokens}")


# the scheduler's knobs that were flat keys of engine_core before its sub-section
_WERE_FLAT = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_waiting",
    "long_prefill_token_threshold",
    "priority_aging_seconds",
    "fair_share",
    "fair_prefill_chunk",
    "priority_isolation",
    "priority_window_s",
    "interrupt_max_tokens",
)


@dataclass(slots=True)
class EngineConfig:
    """Everything an ``LLMEngine`` is built from (the ``engine_core`` section).

    Attributes:
        model_dir: HF checkpoint directory; empty = ``common.config.default_model_dir()``.
        dtype: weight dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``
            (bf16 on CUDA; on CPU the faster of fp32 and bf16, timed at start on a
            small copy of the model at the batches the scheduler makes: a
            ``max_num_seqs`` decode step, a ``max_num_batched_tokens`` prefill
            chunk and a lone decode; attention math stays fp32 on CPU).
        cpu_isa: cap on the CPU instruction sets the engine's own kernels use:
            ``native`` (all this CPU has), ``avx512_bf16`` (no AMX), ``avx512``
            (no BF16 dot products) or ``avx2``; to measure a lower tier on a higher
            CPU. A cap also sets ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``
            for torch where they are unset (set them before start to be sure torch
            obeys: it reads them once); the tier run is in the log and model info.
        device: ``cpu``, ``cuda``, ``cuda:1`` … or ``auto`` (CUDA when present).
        block_size: tokens per KV block.
        num_kv_blocks: pool size; 0 = derive from the memory budget below.
        kv_cache_memory_bytes: KV budget in bytes; 0 = sized from the machine and
            the model: the fraction below, at least one ``max_model_len`` request
            (within half the free memory) and at most ``max_num_seqs`` sequences of
            2,048 tokens (or ``max_model_len`` if shorter); the figure is logged and
            in GetModelInfo's ``compute``.
        kv_cache_memory_fraction: share of free memory (CPU MemAvailable or
            free GPU memory) given to the KV cache, before that floor and cap.
        max_model_len: prompt + output tokens of one request, capped at the model's
            context; 0 = the model's max_position_embeddings.
        scheduler: the scheduler's limits and ordering policy (``SchedulerConfig``);
            its knobs were flat keys of this section before (still read, with a
            deprecation warning, for this release).
        enable_prefix_caching: share full KV blocks between requests with
            the same prefix (hash chain, ref counts, LRU eviction).
        enable_speculative_decoding: default of requests that do not say
            whether to use prompt-lookup speculative decoding.
        num_speculative_tokens: drafts verified per step (k); 0 disables
            speculation entirely, whatever requests ask.
        prompt_lookup_min / prompt_lookup_max: n-gram lengths matched.
        kv_cache_dtype: ``auto`` (bf16 with bf16 weights, or with the fp32
            weights ``dtype: auto`` chose where the CPU kernels read the cache;
            else the attention dtype), ``bfloat16``, ``float32`` or ``fp8``
            (float8_e4m3fn with per-layer, per-head scales).
        quantization: ``none`` or ``fp8`` (per-output-channel e4m3 weights).
        num_threads: torch threads (one pool for matmuls and the CPU kernels);
            0 = torch's default (the cores this process may use), capped at
            the container's cgroup CPU quota rounded up (a pod limited to 2
            CPUs on a 64-core node runs 2 threads, not 64).
        thread_policy: ``adaptive`` (on CPU, at most every half second the step
            loop measures how busy other processes keep this process's CPUs and
            runs on one thread per core they leave free, up to ``num_threads``: a
            co-tenant on one of two cores otherwise stalls every parallel region
            of a step on the thread that shares its core) or ``fixed``; each change
            is logged, the count now is in GetModelInfo's ``compute``.
        tune_linear_paths: on CPU, time the loaded model's projections at
            start-up to choose the skinny-GEMM threshold and weight packing
            (about a second); off = plain F.linear everywhere.
        q4_weights: keep a 4-bit copy of every projection that is exactly
            4-bit per 32-input block (checkpoints converted from Q4_1 GGUF, like
            the default model: lossless) as one more path for the tuning to time,
            with bf16 weights on a CPU with AVX512-BF16 and with fp32 weights on
            any AVX2 CPU; a decode step streams 3.2x (bf16) or 6.4x (fp32) fewer
            bytes. With fp32 weights an LM head that is exactly 8-bit per block
            (a Q8_0 tensor, like the default model's tied embedding) keeps an
            8-bit copy the same way. Ignored without ``tune_linear_paths``.
        compute_cache_dir: where the start-up measurements' outcome is kept (the
            dtype choice, the projections' paths, the prefill attention), a file
            per model, settings, CPU, torch and code version, so the next start on
            this machine applies it without timing (tens of seconds quiet,
            minutes on a busy machine); ``auto`` =
            ``$XDG_CACHE_HOME/llm-serving-stack/compute`` (``~/.cache`` when
            unset), ``""`` = measure at every start. A choice measured on a busy
            machine may be worse: the file records the load average; delete it to
            measure again.
        seed: seed of the engine's unseeded sampling stream.
        guided_cache_entries: compiled output constraints (JSON schemas, regexes,
            grammars of guided decoding) kept for reuse, least recently used dropped
            first; a request whose constraint is cached skips its compilation.
        tensor_parallel_size / pipeline_parallel_size: GPUs one TensorRT-LLM engine
            spans (their product); the native engine runs on one device and
            refuses anything but 1.
    """

    model_dir: str = ""
    dtype: str = "auto"
    cpu_isa: str = "native"
    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory_bytes: int = 0
    kv_cache_memory_fraction: float = 0.2
    max_model_len: int = 0
    scheduler: SchedulerConfig = field(
        default_factory=SchedulerConfig,
        metadata=deprecated_flat_names("", knobs=_WERE_FLAT),
    )
    enable_prefix_caching: bool = True
    enable_speculative_decoding: bool = False
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    kv_cache_dtype: str = "auto"
    quantization: str = "none"
    num_threads: int = 0
    thread_policy: str = "adaptive"
    tune_linear_paths: bool = True
    q4_weights: bool = True
    compute_cache_dir: str = "auto"
    seed: int = 0
    guided_cache_entries: int = 256
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        try:
            self.scheduler.validate()
        except ValueError as e:
            raise ValueError(f"[engine_core.scheduler] {e}") from None

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        """The scheduler's limits, with ``max_model_len`` resolved against the model."""
        max_len = min(self.max_model_len or model_max_len, model_max_len)
        return dataclasses.replace(self.scheduler, max_model_len=max_len)
