// The decoder for a step of decodes only (one token per sequence), in one
// call: no Python between the ~300 operations of a step, and the GIL is free
// for the service's other threads the whole time (llama.cpp runs a token as
// one graph for the same reason). Prefill steps take the Python path.

#include "common.h"
#include "ops.h"

namespace llm_cpu {

namespace {

// up to skinny_max rows: the 4-bit GEMV where the weight has a 4-bit copy
// (``small``), else the streaming bf16/fp32 GEMV; above: the packed copy
at::Tensor project(const at::Tensor& x, const at::Tensor& w, const at::Tensor* packed,
                   const at::Tensor* small, int64_t skinny_max) {
  if (x.size(0) <= skinny_max) return small != nullptr ? q4_linear(x, *small) : skinny_linear(x, w);
  if (packed != nullptr && packed->dim() == 4) return amx_linear(x, *packed);
  if (packed != nullptr) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, *packed, c10::IValue(), std::string("none"),
                            c10::List<std::optional<c10::Scalar>>(), c10::IValue(std::string())};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w);
}

}  // namespace

at::Tensor decode_forward(at::Tensor residual, at::TensorList in_norm, at::TensorList post_norm,
                          at::TensorList weights, at::TensorList packed, at::TensorList small,
                          int64_t skinny_max,
                          const at::Tensor& final_norm, double eps, at::TensorList k_caches,
                          at::TensorList v_caches, at::TensorList kv_scales,
                          const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& positions, const at::Tensor& slot_mapping,
                          const at::Tensor& block_tables, const at::Tensor& context_lens,
                          int64_t num_heads, int64_t num_kv_heads) {
  const int64_t L = static_cast<int64_t>(in_norm.size());
  TORCH_CHECK(L > 0 && post_norm.size() == in_norm.size() &&
                  static_cast<int64_t>(weights.size()) == 4 * L &&
                  (packed.empty() || packed.size() == weights.size()) &&
                  (small.empty() || small.size() == weights.size()) &&
                  static_cast<int64_t>(k_caches.size()) == L && v_caches.size() == k_caches.size() &&
                  (kv_scales.empty() || static_cast<int64_t>(kv_scales.size()) == 2 * L),
              "decode_forward: per-layer lists disagree (", L, " layers)");
  const int64_t D = k_caches[0].size(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto dtype = residual.scalar_type();
  residual = residual.contiguous();
  at::Tensor h;
  for (int64_t l = 0; l < L; ++l) {
    auto w = [&](int64_t i) -> const at::Tensor& { return weights[4 * l + i]; };
    auto p = [&](int64_t i) -> const at::Tensor* {
      return packed.empty() ? nullptr : &packed[4 * l + i];
    };
    auto sm = [&](int64_t i) -> const at::Tensor* {
      return small.empty() ? nullptr : &small[4 * l + i];
    };
    const at::Tensor x = l == 0 ? rms_norm(residual, in_norm[0], eps)
                                : add_rms_norm(h, residual, in_norm[l], eps);
    std::optional<at::Tensor> ks, vs;
    if (!kv_scales.empty()) {
      ks = kv_scales[2 * l];
      vs = kv_scales[2 * l + 1];
    }
    const at::Tensor qkv = rotary_qkv(project(x, w(0), p(0), sm(0), skinny_max), cos, sin, positions,
                                      slot_mapping, k_caches[l], v_caches[l], num_heads,
                                      num_kv_heads, ks, vs, std::nullopt);
    const at::Tensor attn =
        paged_decode_attention(qkv.narrow(1, 0, num_heads), k_caches[l], v_caches[l],
                               block_tables, context_lens, scale, dtype, ks, vs);
    h = project(attn, w(1), p(1), sm(1), skinny_max);
    const at::Tensor x2 = add_rms_norm(h, residual, post_norm[l], eps);
    h = project(silu_and_mul(project(x2, w(2), p(2), sm(2), skinny_max)), w(3), p(3), sm(3),
                skinny_max);
  }
  return add_rms_norm(h, residual, final_norm, eps);
}

}  // namespace llm_cpu
