"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) on paged attention.

Projections are fused (q|k|v and gate|up) so a layer is a handful of large
matmuls. Weights live in ``dtype``; attention math and the KV cache use
``attn_dtype`` (fp32 on CPU, where SDPA in bf16 is several times slower).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine_svc.models.attention import AttentionMetadata, paged_attention
from engine_svc.models.config import ModelConfig
from engine_svc.models.fp8 import Fp8Weight, linear
from engine_svc.models.rotary import RotaryEmbedding


class LlamaLayer:
    """One decoder layer's weights (fused projections) and its forward pass."""

    __slots__ = ("down", "gate_up", "in_norm", "o_proj", "post_norm", "qkv", "qkv_bias")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.in_norm = tensors["input_layernorm"]
        self.post_norm = tensors["post_attention_layernorm"]
        self.qkv: torch.Tensor | Fp8Weight = tensors["qkv_proj"]
        self.qkv_bias = tensors.get("qkv_bias")
        self.o_proj: torch.Tensor | Fp8Weight = tensors["o_proj"]
        self.gate_up: torch.Tensor | Fp8Weight = tensors["gate_up_proj"]
        self.down: torch.Tensor | Fp8Weight = tensors["down_proj"]

    def quantize_fp8(self) -> None:
        """Replace the four projection weights by per-channel FP8 ones."""
        for name in ("qkv", "o_proj", "gate_up", "down"):
            w = getattr(self, name)
            if isinstance(w, torch.Tensor):
                setattr(self, name, Fp8Weight(w))


class LlamaForCausalLM:
    """Llama causal LM whose attention reads and writes a paged KV cache.

    Args:
        config: the model's config.
        weights: HF-named tensors already in the target dtype and device.
        attn_dtype: dtype of attention math and of the KV cache.
    """

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], attn_dtype: torch.dtype
    ) -> None:
        self.config = config
        self.embed_tokens = weights["model.embed_tokens.weight"]
        self.dtype = self.embed_tokens.dtype
        self.device = self.embed_tokens.device
        self.attn_dtype = attn_dtype
        self.norm = weights["model.norm.weight"]
        self.lm_head = weights.get("lm_head.weight", self.embed_tokens)
        self.layers = [LlamaLayer(_fuse_layer(weights, i)) for i in range(config.num_hidden_layers)]
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            self.device,
        )
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Run the decoder over the step's flat tokens.

        Args:
            input_ids: [T] token ids.
            positions: [T] absolute positions.
            meta: attention metadata of the step.
            kv_caches: per layer (k, v) caches [num_blocks, block_size, Hkv, D].
            kv_scales: per layer (k, v) head scales [Hkv] of an FP8 cache.

        Returns:
            [T, hidden] final hidden states (after the last norm).
        """
        cos, sin = self.rotary.lookup(positions)
        cos, sin = cos.to(self.attn_dtype), sin.to(self.attn_dtype)
        h = F.embedding(input_ids, self.embed_tokens)
        num_tokens = h.shape[0]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = self._rms_norm(h, layer.in_norm)
            qkv = linear(x, layer.qkv, layer.qkv_bias).to(self.attn_dtype)
            qkv = qkv.view(num_tokens, nq + 2 * nkv, hd)
            qk = RotaryEmbedding.apply(qkv[:, : nq + nkv], cos, sin)
            attn = paged_attention(
                qk[:, :nq],
                qk[:, nq:],
                qkv[:, nq + nkv :],
                k_cache,
                v_cache,
                meta,
                None if kv_scales is None else kv_scales[i],
            )
            h = h + linear(attn.to(self.dtype), layer.o_proj)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer.down)
        return self._rms_norm(h, self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project selected hidden states [N, hidden] to fp32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head).float()


def _fuse_layer(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    out = {
        "input_layernorm": weights[p + "input_layernorm.weight"],
        "post_attention_layernorm": weights[p + "post_attention_layernorm.weight"],
        "qkv_proj": torch.cat([weights[attn + f"{n}_proj.weight"] for n in "qkv"]),
        "o_proj": weights[attn + "o_proj.weight"],
        "gate_up_proj": torch.cat(
            [weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]
        ),
        "down_proj": weights[mlp + "down_proj.weight"],
    }
    if attn + "q_proj.bias" in weights:
        out["qkv_bias"] = torch.cat([weights[attn + f"{n}_proj.bias"] for n in "qkv"])
    return out
