// LoRA for a batch whose tokens each run their own adapter (punica's BGMV, S-LoRA's gather-matmul):
// y[t] += (x[t] A[s]^T) B[s] with s = slots[t], skipped where s < 0 (the base model).
//
// A Linear may run several projections at once (q, k and v; gate and up): its output's columns
// are cut into parts at `offsets`, and part p of slot s uses the rows [p R, p R + widths[s, p]) of
// A [S, P R, K] and of B [S, P R, N] (B transposed, so that the expand step adds whole rows), B
// only over the part's own columns. The adapters' weights are in the activations' dtype.
//
// The tokens on one slot (a sequence's chunk, the decode tokens of one adapter's sequences) go in
// tiles of up to TILE, each reading its adapter's rows once for all its tokens, from L1: a decode
// step reads each adapter's weights once, not once per sequence. Products are summed in float32,
// and a token's result is added to y once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <utility>
#include <vector>

using at::BFloat16;

namespace {

constexpr int64_t TILE = 8;

template <typename scalar_t>
void lora_tiles(scalar_t* y, const scalar_t* x, const scalar_t* a, const scalar_t* b, const int32_t* slots,
                const int32_t* widths, const int64_t* offsets, int64_t parts, int64_t tokens, int64_t k, int64_t n,
                int64_t r_max) {
  std::vector<int64_t> order;  // the adapted tokens, by slot (stable: in order within one)
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] >= 0) order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return slots[i] < slots[j]; });
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first place in `order`, tokens)
  for (int64_t i = 0; i < static_cast<int64_t>(order.size()); ++i) {
    auto* last = tiles.empty() ? nullptr : &tiles.back();
    if (last && slots[order[last->first]] == slots[order[i]] && last->second < TILE) {
      ++last->second;
    } else {
      tiles.emplace_back(i, 1);
    }
  }
  const int64_t rows = parts * r_max;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(TILE * k), u(TILE * rows), yf(TILE * n);
    for (int64_t i = begin; i < end; ++i) {
      const auto [first, count] = tiles[i];
      const int64_t* tile = order.data() + first;
      const int32_t s = slots[tile[0]];
      for (int64_t c = 0; c < count; ++c) {
        const scalar_t* xt = x + tile[c] * k;
        float* xc = xf.data() + c * k;
#pragma omp simd
        for (int64_t d = 0; d < k; ++d) xc[d] = static_cast<float>(xt[d]);
      }
      std::fill(yf.begin(), yf.begin() + count * n, 0.f);
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t first_row = p * r_max, last_row = first_row + widths[s * parts + p];
        const int64_t lo = offsets[p], hi = offsets[p + 1];
        for (int64_t r = first_row; r < last_row; ++r) {  // shrink: u = A x, an A row for 4 tokens at once
          const scalar_t* arow = a + (s * rows + r) * k;
          int64_t c = 0;
          for (; c + 4 <= count; c += 4) {
            const float *x0 = xf.data() + c * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t d = 0; d < k; ++d) {
              const float av = static_cast<float>(arow[d]);
              a0 += av * x0[d], a1 += av * x1[d], a2 += av * x2[d], a3 += av * x3[d];
            }
            u[c * rows + r] = a0, u[(c + 1) * rows + r] = a1, u[(c + 2) * rows + r] = a2, u[(c + 3) * rows + r] = a3;
          }
          for (; c < count; ++c) {
            const float* xc = xf.data() + c * k;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < k; ++d) acc += static_cast<float>(arow[d]) * xc[d];
            u[c * rows + r] = acc;
          }
        }
        for (int64_t r = first_row; r < last_row; r += 4) {  // expand: y += B u, 4 rows of B at once
          const int64_t group = std::min<int64_t>(4, last_row - r);
          const scalar_t* b0 = b + (s * rows + r) * n;
          const scalar_t *b1 = b0 + n * (group > 1), *b2 = b0 + n * 2 * (group > 2), *b3 = b0 + n * 3 * (group > 3);
          for (int64_t c = 0; c < count; ++c) {  // a missing row of the 4 repeats the first at weight 0
            const float* uc = u.data() + c * rows + r;
            const float u0 = uc[0], u1 = group > 1 ? uc[1] : 0.f, u2 = group > 2 ? uc[2] : 0.f,
                        u3 = group > 3 ? uc[3] : 0.f;
            float* yc = yf.data() + c * n;
#pragma omp simd
            for (int64_t j = lo; j < hi; ++j) {
              yc[j] += u0 * static_cast<float>(b0[j]) + u1 * static_cast<float>(b1[j]) +
                       u2 * static_cast<float>(b2[j]) + u3 * static_cast<float>(b3[j]);
            }
          }
        }
      }
      for (int64_t c = 0; c < count; ++c) {
        scalar_t* yt = y + tile[c] * n;
        const float* yc = yf.data() + c * n;
        for (int64_t j = 0; j < n; ++j) yt[j] = static_cast<scalar_t>(static_cast<float>(yt[j]) + yc[j]);
      }
    }
  });
}

}  // namespace

// y [T, N] += LoRA(x [T, K]) in place; x, y and the slots' A and B of one dtype, float32 or bf16.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
              torch::Tensor widths, torch::Tensor offsets) {
  for (const auto* t : {&y, &x, &a, &b}) {
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == x.scalar_type(),
                "lora_add takes contiguous x, y and adapter slots of one dtype");
  }
  TORCH_CHECK(slots.scalar_type() == at::kInt && widths.scalar_type() == at::kInt &&
              offsets.scalar_type() == at::kLong, "lora_add takes int32 slots and widths, int64 offsets");
  const int64_t tokens = x.size(0), k = x.size(1), n = y.size(1), parts = widths.size(1);
  const int64_t r_max = a.size(1) / parts;
  TORCH_CHECK(y.size(0) == tokens && slots.size(0) == tokens && a.size(2) == k && b.size(1) == a.size(1) &&
              b.size(2) == n && offsets.size(0) == parts + 1 && widths.size(0) == a.size(0),
              "lora_add: shapes do not agree");
  const int32_t* ss = slots.data_ptr<int32_t>();
  const int32_t* ws = widths.data_ptr<int32_t>();
  const int64_t* os = offsets.data_ptr<int64_t>();
  if (x.scalar_type() == at::kBFloat16) {
    lora_tiles(y.data_ptr<BFloat16>(), x.data_ptr<BFloat16>(), a.data_ptr<BFloat16>(), b.data_ptr<BFloat16>(), ss,
               ws, os, parts, tokens, k, n, r_max);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "lora_add takes float32 or bf16, got ", x.scalar_type());
    lora_tiles(y.data_ptr<float>(), x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), ss, ws, os,
               parts, tokens, k, n, r_max);
  }
}
