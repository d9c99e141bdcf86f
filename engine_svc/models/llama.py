"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) on paged attention.

The same decoder serves Mistral, Qwen2/3 and Gemma 2/3 through ``ModelConfig``'s
flags: q/k/v bias, q/k norms before RoPE, scaled embeddings, GeGLU, norms on
both sublayers' outputs, softcapping and sliding windows (``windowed``).

Projections are fused (q|k|v and gate|up) so a layer is four matmuls plus
four fused small ops (``ops``: add+RMSNorm, RoPE with the KV write, decode
attention, SiLU-and-mul). Weights live in ``dtype`` as ``Linear`` objects
(oneDNN-prepacked on CPU when chosen) or FP8; attention math and the KV cache
use ``attn_dtype`` (fp32 on CPU, where SDPA in bf16 is several times slower).
The residual stream stays in ``dtype`` and is updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_svc.models import ops
from engine_svc.models.attention import AttentionMetadata, paged_attention
from engine_svc.models.config import ModelConfig
from engine_svc.models.fp8 import Fp8Weight, fp8_linear
from engine_svc.models.linear import Linear
from engine_svc.models.q4 import q4_pack, q8_pack
from engine_svc.models.rotary import RotaryEmbedding
from engine_svc.models.windowed import windowed_attention

Projection = Linear | Fp8Weight


def _project(x: torch.Tensor, w: Projection) -> torch.Tensor:
    return fp8_linear(x, w) if isinstance(w, Fp8Weight) else w(x)


class LlamaLayer:
    """One decoder layer's weights (fused projections).

    Args:
        tensors: the fused layer tensors (``_fuse_layer``).
        fp8: quantize the projections to per-channel FP8.
        exact: the same fused tensors in fp32 as stored, to keep a 4-bit packing of
            each projection that is exactly 4-bit per block (``q4.q4_pack``).
    """

    __slots__ = (
        "down", "gate_up", "in_norm", "k_norm", "o_proj", "post_ff_norm", "post_norm",
        "pre_ff_norm", "q_norm", "qkv",
    )  # fmt: skip

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        fp8: bool = False,
        exact: dict[str, torch.Tensor] | None = None,
    ) -> None:
        def proj(name: str, bias: torch.Tensor | None = None) -> Projection:
            if fp8 and bias is None:
                return Fp8Weight(tensors[name])
            packed = q4_pack(exact[name]) if exact is not None and bias is None else None
            return Linear(tensors[name], bias, q4=packed)

        self.in_norm = tensors["input_layernorm"]
        self.post_norm = tensors["post_attention_layernorm"]
        self.qkv = proj("qkv_proj", tensors.get("qkv_bias"))
        self.o_proj = proj("o_proj", tensors.get("o_bias"))
        self.gate_up = proj("gate_up_proj")
        self.down = proj("down_proj")
        # Qwen3 / Gemma 3 q and k norms; Gemma's norms around the MLP (None elsewhere)
        self.q_norm = tensors.get("q_norm")
        self.k_norm = tensors.get("k_norm")
        self.pre_ff_norm = tensors.get("pre_feedforward_layernorm")
        self.post_ff_norm = tensors.get("post_feedforward_layernorm")


class LlamaForCausalLM:
    """Llama causal LM whose attention reads and writes a paged KV cache.

    Args:
        config: the model's config.
        weights: HF-named tensors already in the target dtype and device.
        attn_dtype: dtype of attention math and of the KV cache.
        fp8: per-channel FP8 decoder projections.
        exact: the checkpoint's tensors in fp32, when 4-bit packings should be
            tried (``ops.q4_applies``: bf16 or fp32 weights where the q4 kernel
            runs them); not kept.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        attn_dtype: torch.dtype,
        fp8: bool = False,
        exact: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.dtype = self.embed_tokens.dtype
        self.device = self.embed_tokens.device
        self.attn_dtype = attn_dtype
        self.prefill_attn_dtype: torch.dtype | None = None  # None = attn_dtype
        self.prefill_attn_kernel = False  # the fused prefill attention (paged bf16 cache)
        self.norm = _norm_weight(weights["model.norm.weight"], config)
        # tied (the checkpoint stores no LM head; one it does store wins, as in transformers)
        head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
        # an exactly-8-bit head (a Q8_0 embedding) keeps an 8-bit copy where it can run
        q8 = None
        if exact is not None and ops.q8_applies(self.dtype, self.device):
            q8 = q8_pack(exact[head])
        self.lm_head = Linear(weights[head], q8=q8)
        self.layers = [
            LlamaLayer(
                _fuse_layer(weights, i, config),
                fp8,
                None if exact is None else _fuse_layer(exact, i, config),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            self.device,
        )
        local = self.rotary
        if config.local_rope_theta is not None:
            local = RotaryEmbedding(
                config.head_dim, config.max_position_embeddings, config.local_rope_theta, None,
                self.device,
            )  # fmt: skip
        self.sliding = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
        self.rope = [local if s else self.rotary for s in self.sliding]
        # Gemma: embeddings times sqrt(hidden) rounded to the weight dtype, as HF does
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=self.device)
            if config.scale_embeddings
            else None
        )
        self.act = ops.silu_and_mul if config.hidden_act == "silu" else ops.gelu_tanh_and_mul
        self.eps = config.rms_norm_eps
        # the compiled whole-step decode path is Llama's layer with plain (unbiased,
        # non-FP8) projections: no q/k norm, GeGLU, extra norms or softcapped attention
        llama_layer = not (
            config.qk_norm or config.sandwich_norm or config.hidden_act != "silu"
            or config.attn_softcap is not None
        )  # fmt: skip
        projections = [
            w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
        ]
        self._plain: list[Linear] | None = None
        if llama_layer and all(isinstance(w, Linear) and w.bias is None for w in projections):
            self._plain = [w for w in projections if isinstance(w, Linear)]
        # their 4-bit copies (fixed at load), all or none: the few-row path of the step
        small = [w.q4 for w in self._plain or () if w.q4 is not None]
        self._small = small if self._plain is not None and len(small) == len(self._plain) else []
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim

    def linears(self) -> list[Linear]:
        """Every ``Linear`` of the model (the LM head last), for path tuning."""
        out = [
            w
            for layer in self.layers
            for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if isinstance(w, Linear)
        ]
        return [*out, self.lm_head]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Run the decoder over the step's flat tokens.

        Args:
            input_ids: [T] token ids.
            positions: [T] absolute positions.
            meta: attention metadata of the step.
            kv_caches: per layer (k, v) caches [num_blocks, block_size, Hkv, D].
            kv_scales: per layer (k, v) head scales [Hkv] of an FP8 cache.
            between_layers: called after every layer but the last (not on the
                compiled decode-only path); it may run a whole other step, which
                must not touch this step's KV slots.

        Returns:
            [T, hidden] final hidden states (after the last norm).
        """
        nq, nkv = self.num_heads, self.num_kv_heads
        residual = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        # a context past the sliding window: the sliding layers attend in ``windowed``
        window = self.config.sliding_window
        beyond = window is not None and int(positions.max()) >= window
        if self._plain is not None and not beyond and meta.num_decode_tokens == len(input_ids):
            out = self._decode_step(residual, positions, meta, kv_caches, kv_scales)
            if out is not None:
                return out
        # the bf16 fused prefill kernel reads q in bf16: the rotation writes it so, no
        # fp32 copy (the fp32 kernel reads the rotation's own fp32)
        bf16_kernel = meta.prefill_kernel and ops.prefill_kernel_dtype() == torch.bfloat16
        rotated = torch.bfloat16 if bf16_kernel else None
        softcap = self.config.attn_softcap
        h: torch.Tensor | None = None
        last = len(self.layers) - 1
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if h is None:
                x = ops.rms_norm(residual, layer.in_norm, self.eps)
            else:
                x = ops.add_rms_norm(h, residual, layer.in_norm, self.eps)
            scales = None if kv_scales is None else kv_scales[i]
            qkv = _project(x, layer.qkv)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv = self._qk_norm(qkv, layer.q_norm, layer.k_norm)
            rope = self.rope[i]
            qkv = ops.rotary_qkv(
                qkv, rope.cos, rope.sin, positions, meta.slot_mapping,
                k_cache, v_cache, nq, nkv, scales, rotated,
            )  # fmt: skip
            q, k, v = qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :]
            if softcap is not None or (beyond and self.sliding[i]):
                attn = windowed_attention(
                    q, k, v, k_cache, v_cache, positions, meta,
                    window if self.sliding[i] else None, softcap, scales, self.dtype,
                )  # fmt: skip
            else:
                attn = paged_attention(
                    q, k, v, k_cache, v_cache, meta, scales,
                    cache_written=True, out_dtype=self.dtype,
                )  # fmt: skip
            h = _project(attn, layer.o_proj)
            if layer.pre_ff_norm is not None and layer.post_ff_norm is not None:  # Gemma
                h = ops.rms_norm(h, layer.post_norm, self.eps)
                x = ops.add_rms_norm(h, residual, layer.pre_ff_norm, self.eps)
                h = ops.rms_norm(
                    _project(self.act(_project(x, layer.gate_up)), layer.down),
                    layer.post_ff_norm,
                    self.eps,
                )
            else:
                x = ops.add_rms_norm(h, residual, layer.post_norm, self.eps)
                h = _project(self.act(_project(x, layer.gate_up)), layer.down)
            if between_layers is not None and i < last:
                between_layers()
        assert h is not None, "a model has at least one layer"
        return ops.add_rms_norm(h, residual, self.norm, self.eps)

    def _qk_norm(
        self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor
    ) -> torch.Tensor:
        """RMSNorm of every q and k head (Qwen3, Gemma 3) in a fused projection [T, ...]."""
        t, nq, nkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = qkv.reshape(t, -1, d)
        q = ops.rms_norm(x[:, :nq].reshape(-1, d), q_norm, self.eps).view(t, nq, d)
        k = ops.rms_norm(x[:, nq : nq + nkv].reshape(-1, d), k_norm, self.eps).view(t, nkv, d)
        return torch.cat((q, k, x[:, nq + nkv :]), dim=1).view(t, -1)

    def _decode_step(
        self,
        residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> torch.Tensor | None:
        """A decode-only step in one compiled call; None when that path cannot run here."""
        plain = self._plain
        if plain is None or not ops.decode_forward_usable(residual, kv_caches[0][0]):
            return None
        assert meta.decode_blocks is not None
        assert meta.decode_context_lens is not None
        packed = [w.packed for w in plain if w.packed is not None]
        return ops.decode_forward(
            residual,
            [layer.in_norm for layer in self.layers],
            [layer.post_norm for layer in self.layers],
            [w.weight for w in plain],
            packed if len(packed) == len(plain) else [],
            self._small,
            plain[0].skinny_max_rows,
            self.norm,
            self.eps,
            kv_caches,
            kv_scales,
            self.rotary.cos,
            self.rotary.sin,
            positions,
            meta.slot_mapping,
            meta.decode_blocks,
            meta.decode_context_lens,
            self.num_heads,
            self.num_kv_heads,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden states [N, hidden] to fp32 logits [N, vocab]
        (softcapped where the config says so: Gemma 2)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _norm_weight(w: torch.Tensor, config: ModelConfig, scale: float = 1.0) -> torch.Tensor:
    """A norm's weight as the kernels take it: Gemma's ``1 + w`` folded in fp32, times
    ``scale``, in the stored dtype."""
    if not config.norm_offset and scale == 1.0:
        return w
    return ((1.0 + w.float() if config.norm_offset else w.float()) * scale).to(w.dtype)


def _fuse_layer(
    weights: dict[str, torch.Tensor], i: int, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s tensors fused (q|k|v, gate|up), norms as the kernels take them, and
    any query scale other than head_dim ** -0.5 (Gemma) folded into q (its norm, or its
    rows and bias): every attention path then scales by head_dim ** -0.5."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    q_scale = 1.0
    if config.query_scale is not None:
        q_scale = config.query_scale * config.head_dim**0.5
    qk_norm = attn + "q_norm.weight" in weights
    row_scale = 1.0 if qk_norm else q_scale

    def scaled(t: torch.Tensor) -> torch.Tensor:
        return t if row_scale == 1.0 else (t.float() * row_scale).to(t.dtype)

    out = {
        "input_layernorm": _norm_weight(weights[p + "input_layernorm.weight"], config),
        "post_attention_layernorm": _norm_weight(
            weights[p + "post_attention_layernorm.weight"], config
        ),
        "qkv_proj": torch.cat(
            [scaled(weights[attn + "q_proj.weight"])]
            + [weights[attn + f"{n}_proj.weight"] for n in "kv"]
        ),
        "o_proj": weights[attn + "o_proj.weight"],
        "gate_up_proj": torch.cat(
            [weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]
        ),
        "down_proj": weights[mlp + "down_proj.weight"],
    }
    if attn + "q_proj.bias" in weights:
        out["qkv_bias"] = torch.cat(
            [scaled(weights[attn + "q_proj.bias"])]
            + [weights[attn + f"{n}_proj.bias"] for n in "kv"]
        )
    if attn + "o_proj.bias" in weights:
        out["o_bias"] = weights[attn + "o_proj.bias"]
    if qk_norm:
        out["q_norm"] = _norm_weight(weights[attn + "q_norm.weight"], config, q_scale)
        out["k_norm"] = _norm_weight(weights[attn + "k_norm.weight"], config)
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
        if p + name + ".weight" in weights:
            out[name] = _norm_weight(weights[p + name + ".weight"], config)
    return out
