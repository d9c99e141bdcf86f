// Registration of the CPU operators as torch ops (torch.ops.llm_cpu.*); each op
// family lives in its own source (see ops.h), built together into one library.

#include <torch/library.h>

#include "ops.h"
#include "prefill_block.h"

using namespace llm_cpu;

TORCH_LIBRARY(llm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("q4_available(ScalarType dtype) -> bool", &q4_available);
  m.def("q4_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("q8_linear(Tensor x, Tensor packed) -> Tensor");
  m.def("prefill_attention_available() -> bool", &prefill_attention_available);
  m.def("prefill_attention_f32_available() -> bool", &prefill_attention_f32_available);
  m.def(
      "prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqs, Tensor tables, "
      "float scale) -> Tensor");
  m.def("fp8_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("fp8_dequant_bf16(Tensor w, Tensor(a!) out) -> ()");
  m.def(
      "decode_forward(Tensor(a!) residual, Tensor[] in_norm, Tensor[] post_norm, "
      "Tensor[] weights, Tensor[] packed, Tensor[] small, int skinny_max, Tensor final_norm, float eps, "
      "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] kv_scales, Tensor cos, "
      "Tensor sin, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
      "Tensor context_lens, int num_heads, int num_kv_heads) -> Tensor");
  m.def(
      "rotary_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, "
      "Tensor(a!)? k_cache, Tensor(b!)? v_cache, int num_heads, int num_kv_heads, "
      "Tensor? k_scale=None, Tensor? v_scale=None, ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale, ScalarType out_dtype, Tensor? k_scale=None, "
      "Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("skinny_linear", &skinny_linear);
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
  m.impl("q4_linear", &q4_linear);
  m.impl("q8_linear", &q8_linear);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("fp8_gemv", &fp8_gemv);
  m.impl("fp8_dequant_bf16", &fp8_dequant_bf16);
  m.impl("decode_forward", &decode_forward);
  m.impl("rotary_qkv", &rotary_qkv);
  m.impl("paged_decode_attention", &paged_decode_attention);
}

// decode_forward's packed weights are oneDNN tensors, which would otherwise
// send the whole call to the MkldnnCPU dispatch key
TORCH_LIBRARY_IMPL(llm_cpu, MkldnnCPU, m) {
  m.impl("decode_forward", &decode_forward);
}
