// RoPE on the fused qkv projection, with the KV-cache write.

#include "common.h"
#include "ops.h"

namespace llm_cpu {

namespace {

// ---------------------------------------------------------------- RoPE + KV write
// Returns fp32 [T, H + 2 * Hkv, D]: q and k rotated, v copied. When caches are
// given (fp32, bf16, or e4m3 with per-head scales), also writes each token's k
// and v at its slot (FP8: divided by the head's scale, clamped to +-448, then
// rounded to nearest even like torch's cast).
template <typename C>
inline C to_cache(float v, float inv_scale) {
  if constexpr (std::is_same_v<C, Float8>) {
    return Float8(std::min(std::max(v * inv_scale, -kFp8Max), kFp8Max));
  } else {
    return from_f<C>(v);
  }
}

template <typename T, typename C, typename O>
void rotary_rows(const T* qkv, const float* cos, const float* sin, const int64_t* pos,
                 const int64_t* slots, C* kc, C* vc, const float* k_inv, const float* v_inv,
                 O* out, int64_t t0, int64_t t1, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t half = D / 2, heads = H + 2 * Hkv, row = heads * D;
  std::vector<float> buf(static_cast<size_t>(row));  // one row in fp32, then out and the cache
  float* dst = buf.data();
  for (int64_t t = t0; t < t1; ++t) {
    const T* src = qkv + t * row;
    const float* c = cos + pos[t] * half;
    const float* s = sin + pos[t] * half;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const T* x = src + h * D;
      float* y = dst + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
        y[i] = x1 * c[i] - x2 * s[i];
        y[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
    for (int64_t i = (H + Hkv) * D; i < row; ++i) dst[i] = to_f(src[i]);
    O* o = out + t * row;
    for (int64_t i = 0; i < row; ++i) o[i] = from_f<O>(dst[i]);
    if (kc != nullptr) {
      C* kd = kc + slots[t] * Hkv * D;
      C* vd = vc + slots[t] * Hkv * D;
      const float* ks = dst + H * D;
      const float* vs = dst + (H + Hkv) * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const float ki = k_inv ? k_inv[h] : 1.f, vi = v_inv ? v_inv[h] : 1.f;
        for (int64_t i = h * D; i < (h + 1) * D; ++i) {
          kd[i] = to_cache<C>(ks[i], ki);
          vd[i] = to_cache<C>(vs[i], vi);
        }
      }
    }
  }
}

}  // namespace

at::Tensor rotary_qkv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& positions, const at::Tensor& slot_mapping,
                      const std::optional<at::Tensor>& k_cache,
                      const std::optional<at::Tensor>& v_cache, int64_t num_heads,
                      int64_t num_kv_heads, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale,
                      std::optional<at::ScalarType> out_dtype) {
  check_cpu(qkv, "qkv");
  check_cpu(cos, "cos");
  check_cpu(sin, "sin");
  check_cpu(positions, "positions");
  check_cpu(slot_mapping, "slot_mapping");
  TORCH_CHECK(float_or_bf16(qkv), "rotary_qkv: qkv must be float32 or bfloat16");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotary_qkv: cos/sin tables must be float32");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "rotary_qkv: positions and slot_mapping must be int64");
  const int64_t T = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  const int64_t D = qkv.size(1) / heads;
  TORCH_CHECK(D * heads == qkv.size(1) && D % 2 == 0 && cos.size(1) * 2 == D,
              "rotary_qkv: qkv width does not match the head counts and the RoPE table");
  const bool write = k_cache.has_value() && v_cache.has_value();
  if (write) {
    check_cpu(*k_cache, "k_cache");
    check_cpu(*v_cache, "v_cache");
    TORCH_CHECK(k_cache->scalar_type() == v_cache->scalar_type() && kv_cache_type(*k_cache),
                "rotary_qkv: caches must be float32, bfloat16 or float8_e4m3fn");
  }
  const bool fp8 = write && k_cache->scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()),
              "rotary_qkv: k_scale and v_scale are required for, and only for, an FP8 cache");
  at::Tensor k_inv, v_inv;
  if (fp8) {
    TORCH_CHECK(k_scale->scalar_type() == at::kFloat && k_scale->numel() == num_kv_heads &&
                    v_scale->scalar_type() == at::kFloat && v_scale->numel() == num_kv_heads,
                "rotary_qkv: k_scale and v_scale must be float32 [Hkv]");
    k_inv = k_scale->reciprocal().contiguous();
    v_inv = v_scale->reciprocal().contiguous();
  }
  const float* kip = fp8 ? k_inv.data_ptr<float>() : nullptr;
  const float* vip = fp8 ? v_inv.data_ptr<float>() : nullptr;
  const auto odt = out_dtype.value_or(at::kFloat);
  TORCH_CHECK(odt == at::kFloat || odt == at::kBFloat16,
              "rotary_qkv: out_dtype must be float32 or bfloat16");
  auto out = at::empty({T, heads, D}, qkv.options().dtype(odt));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  const int64_t* slp = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rotary_qkv", [&] {
    using T_ = scalar_t;
    const T_* xp = qkv.data_ptr<T_>();
    auto run = [&](auto* kc, auto* vc) {
      at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
        if (odt == at::kFloat) {
          rotary_rows(xp, cp, sp, pp, slp, kc, vc, kip, vip, out.data_ptr<float>(), b, e,
                      num_heads, num_kv_heads, D);
        } else {
          rotary_rows(xp, cp, sp, pp, slp, kc, vc, kip, vip, out.data_ptr<BFloat16>(), b, e,
                      num_heads, num_kv_heads, D);
        }
      });
    };
    if (!write) {
      run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
    } else if (k_cache->scalar_type() == at::kFloat) {
      run(k_cache->data_ptr<float>(), v_cache->data_ptr<float>());
    } else if (k_cache->scalar_type() == at::kBFloat16) {
      run(k_cache->data_ptr<BFloat16>(), v_cache->data_ptr<BFloat16>());
    } else {
      run(k_cache->data_ptr<Float8>(), v_cache->data_ptr<Float8>());
    }
  });
  return out;
}

}  // namespace llm_cpu
