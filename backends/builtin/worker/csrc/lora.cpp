// LoRA for a batch whose tokens each run their own adapter (punica's BGMV, S-LoRA's gather-matmul):
// y[t] += (x[t] A[s]^T) B[s] with s = slots[t], skipped where s < 0 (the base model). The adapters'
// weights sit in compute slots, float32, of `widths[s]` ranks in use: A [S, R, K] (its rows) and
// B [S, R, N] (its columns, transposed, so that the expand step adds whole rows of N).
// Every token's rank-sized intermediate is summed in float32, whatever y's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

using at::BFloat16;

template <typename scalar_t>
static void lora_tokens(scalar_t* y, const scalar_t* x, const float* a, const float* b, const int32_t* slots,
                        const int32_t* widths, int64_t tokens, int64_t k, int64_t n, int64_t r_max) {
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(k), yf(n), u(r_max);
    for (int64_t t = begin; t < end; ++t) {
      const int32_t s = slots[t];
      if (s < 0) continue;
      const int64_t width = widths[s];
      const scalar_t* xt = x + t * k;
      for (int64_t i = 0; i < k; ++i) xf[i] = static_cast<float>(xt[i]);
      const float* as = a + s * r_max * k;
      for (int64_t r = 0; r < width; ++r) {  // shrink: u = A x
        const float* row = as + r * k;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < k; ++i) acc += row[i] * xf[i];
        u[r] = acc;
      }
      std::fill(yf.begin(), yf.end(), 0.f);
      const float* bs = b + s * r_max * n;
      for (int64_t r = 0; r < width; ++r) {  // expand: y += B u, a row of B^T at a time
        const float* row = bs + r * n;
        const float ur = u[r];
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) yf[j] += ur * row[j];
      }
      scalar_t* yt = y + t * n;
      for (int64_t j = 0; j < n; ++j) yt[j] = static_cast<scalar_t>(static_cast<float>(yt[j]) + yf[j]);
    }
  });
}

// y [T, N] += LoRA(x [T, K]) in place, y and x float32 or bf16.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
              torch::Tensor widths) {
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && y.scalar_type() == x.scalar_type(),
              "lora_add takes contiguous x and y of one dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat && a.is_contiguous() && b.is_contiguous(),
              "lora_add takes contiguous float32 adapter slots");
  TORCH_CHECK(slots.scalar_type() == at::kInt && widths.scalar_type() == at::kInt, "lora_add takes int32 slots");
  const int64_t tokens = x.size(0), k = x.size(1), n = y.size(1), r_max = a.size(1);
  TORCH_CHECK(y.size(0) == tokens && slots.size(0) == tokens && a.size(2) == k && b.size(1) == r_max &&
              b.size(2) == n, "lora_add: shapes do not agree");
  const float* as = a.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  const int32_t* ss = slots.data_ptr<int32_t>();
  const int32_t* ws = widths.data_ptr<int32_t>();
  if (x.scalar_type() == at::kBFloat16) {
    lora_tokens(y.data_ptr<BFloat16>(), x.data_ptr<BFloat16>(), as, bs, ss, ws, tokens, k, n, r_max);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "lora_add takes float32 or bf16, got ", x.scalar_type());
    lora_tokens(y.data_ptr<float>(), x.data_ptr<float>(), as, bs, ss, ws, tokens, k, n, r_max);
  }
}
