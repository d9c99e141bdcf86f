// The CPU operators, one family a source, registered in cpu_ops.cpp:
//   norm_act.cpp          rms_norm, add_rms_norm, silu_and_mul
//   rotary.cpp            rotary_qkv (RoPE with the KV-cache write)
//   decode_attention.cpp  paged_decode_attention
//   prefill_attention.cpp prefill_attention (AMX or AVX512-BF16; fp32 q: ..._f32.cpp, AVX2)
//   linear.cpp            skinny_linear, fp8_gemv, fp8_dequant_bf16, amx_pack, amx_linear
//   q4_linear.cpp         q4_linear (4-bit weights), q8_linear (8-bit, fp32 rows)
//   sampling.cpp          argmax_rows
//   decode_forward.cpp    decode_forward (a whole decode-only step)
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace llm_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps);
at::Tensor silu_and_mul(const at::Tensor& x);

at::Tensor rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slot_mapping,
                      const std::optional<at::Tensor>& k_cache,
                      const std::optional<at::Tensor>& v_cache, int64_t num_heads,
                      int64_t num_kv_heads, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale,
                      std::optional<at::ScalarType> out_dtype);

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale,
                                  at::ScalarType out_dtype,
                                  const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale);

bool prefill_attention_available();
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& seqs,
                             const at::Tensor& tables, double scale);

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor fp8_gemv(const at::Tensor& x, const at::Tensor& w);
void fp8_dequant_bf16(const at::Tensor& w, at::Tensor out);
bool amx_available();
at::Tensor amx_pack(const at::Tensor& w);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed);

bool q4_available(at::ScalarType dtype);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& packed);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& packed);

at::Tensor argmax_rows(const at::Tensor& logits);

at::Tensor decode_forward(at::Tensor residual, at::TensorList in_norm, at::TensorList post_norm,
                          at::TensorList weights, at::TensorList packed, at::TensorList small,
                          int64_t skinny_max, const at::Tensor& final_norm, double eps,
                          at::TensorList k_caches, at::TensorList v_caches,
                          at::TensorList kv_scales, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          int64_t num_heads, int64_t num_kv_heads);

}  // namespace llm_cpu
