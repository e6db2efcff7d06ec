// A decoder layer's element-wise work for bf16 activations, one pass each where PyTorch runs
// three to eight operators (each of which costs more to dispatch than to compute at a decode
// step's few rows). Every result is rounded to bf16 where PyTorch's bf16 operators round it, so
// the outputs are those of the model's PyTorch path (the tests hold them to it), but for RMSNorm's sum of
// squares, added in another order: a bf16 ulp now and then.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "vec_exp.h"

using at::BFloat16;

static inline BFloat16 bf16(float x) { return BFloat16(x); }  // round to nearest even

// residual = x + residual; x = weight * rms_norm(residual), both in place ([T, hidden] bf16).
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous() && residual.is_contiguous() &&
                  residual.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "add_rms_norm takes contiguous bf16 tensors");
  const int64_t rows = x.size(0), dim = x.size(1);
  BFloat16* xs = x.data_ptr<BFloat16>();
  BFloat16* rs = residual.data_ptr<BFloat16>();
  const BFloat16* w = weight.data_ptr<BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      BFloat16* xr = xs + t * dim;
      BFloat16* rr = rs + t * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        rr[d] = bf16(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
        squares += static_cast<float>(rr[d]) * static_cast<float>(rr[d]);
      }
      const float inv = 1.f / std::sqrt(squares / dim + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d)
        xr[d] = bf16(static_cast<float>(w[d]) * static_cast<float>(bf16(static_cast<float>(rr[d]) * inv)));
    }
  });
}

// Rotary embedding (rotate-half layout) of the query and key heads of qkv ([T, (H + 2 Hkv) * D]
// bf16, in place); cos and sin are [T, D] bf16.
void rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "rotary takes contiguous bf16 tensors");
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = cos.size(1), half = dim / 2;
  BFloat16* data = qkv.data_ptr<BFloat16>();
  const BFloat16* cs = cos.data_ptr<BFloat16>();
  const BFloat16* sn = sin.data_ptr<BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const BFloat16* c = cs + t * dim;
      const BFloat16* s = sn + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        BFloat16* x = data + t * width + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float lo = x[d], hi = x[d + half];
          // x * cos + rotate_half(x) * sin, rounded after each product and the sum, as PyTorch does
          x[d] = bf16(static_cast<float>(bf16(lo * static_cast<float>(c[d]))) +
                      static_cast<float>(bf16(-hi * static_cast<float>(s[d]))));
          x[d + half] = bf16(static_cast<float>(bf16(hi * static_cast<float>(c[d + half]))) +
                             static_cast<float>(bf16(lo * static_cast<float>(s[d + half]))));
        }
      }
    }
  });
}

// silu(gate) * up of gate_up ([T, 2 I] bf16) -> [T, I] bf16.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(), "silu_mul takes contiguous bf16");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inner}, gate_up.options());
  const BFloat16* in = gate_up.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const BFloat16* g = in + t * 2 * inner;
      const BFloat16* u = g + inner;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      // silu(x) = x * sigmoid(x), the sigmoid from exp(-|x|) so that it never overflows.
      const auto widen = [](const BFloat16* p) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
      };
      const auto narrow = [](__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); };  // to nearest even
      for (; i + 16 <= inner; i += 16) {
        const __m512 x = widen(g + i), e = exp512_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
        const __m512 sigmoid = _mm512_div_ps(
            _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_set1_ps(1.f), e),
            _mm512_add_ps(_mm512_set1_ps(1.f), e));
        const __m256i silu = narrow(_mm512_mul_ps(x, sigmoid));
        const __m512 silu_f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(silu), 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + t * inner + i), narrow(_mm512_mul_ps(silu_f, widen(u + i))));
      }
#endif
      for (; i < inner; ++i) {
        const float x = g[i];
        o[t * inner + i] = bf16(static_cast<float>(bf16(x / (1.f + std::exp(-x)))) * static_cast<float>(u[i]));
      }
    }
  });
  return out;
}
