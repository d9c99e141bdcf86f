// Sampling: the greedy pick.

#include "common.h"
#include "ops.h"

namespace llm_cpu {

// ---------------------------------------------------------------- greedy pick
// Index of the first maximum of each row of fp32 logits [N, V] (torch.argmax's
// tie rule): a vectorized max, then the first position holding it.
at::Tensor argmax_rows(const at::Tensor& logits) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0,
              "argmax_rows: logits must be float32 [N, V] with V > 0");
  const int64_t n = logits.size(0), v = logits.size(1);
  auto out = at::empty({n}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = lp + r * v;
      float part[16];  // 16 running maxima: a reduction gcc vectorizes
      for (int64_t j = 0; j < 16; ++j) part[j] = row[0];
      int64_t i = 0;
      for (; i + 16 <= v; i += 16)
        for (int64_t j = 0; j < 16; ++j) part[j] = row[i + j] > part[j] ? row[i + j] : part[j];
      float m = row[0];
      for (; i < v; ++i) m = row[i] > m ? row[i] : m;
      for (int64_t j = 0; j < 16; ++j) m = part[j] > m ? part[j] : m;
      int64_t idx = 0;
      while (idx < v && row[idx] != m) ++idx;
      op[r] = idx < v ? idx : 0;  // a NaN row: no element equals the max
    }
  });
  return out;
}

}  // namespace llm_cpu
