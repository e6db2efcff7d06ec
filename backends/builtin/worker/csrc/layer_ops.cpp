// A decoder layer's element-wise work, one pass each where PyTorch runs three to eight operators
// (each of which costs more to dispatch than to compute at a decode step's few rows), for float32
// and bf16 activations. In bf16 every result is rounded where PyTorch's bf16 operators round it,
// so the outputs are those of the model's PyTorch path (the tests hold them to it), but for
// RMSNorm's sum of squares, added in another order: a bf16 ulp now and then. In float32 nothing
// is rounded between steps; that order and the compiler's fused multiply-adds move a last bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "vec_exp.h"

using at::BFloat16;

// x stored as scalar_t (bf16: to nearest even). Through a function, not a temporary of the type:
// GCC vectorizes no loop that copies a bf16 temporary, and the sum of squares then changes order.
template <typename scalar_t>
static inline scalar_t narrowed(float x) { return scalar_t(x); }

// x as PyTorch's operators on scalar_t leave an intermediate: rounded to bf16, or kept in float32.
template <typename scalar_t>
static inline float rounded(float x) {
  if constexpr (std::is_same_v<scalar_t, BFloat16>) return static_cast<float>(BFloat16(x));  // to nearest even
  return x;
}

static void check(const torch::Tensor& t, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == dtype, op,
              " takes contiguous tensors of one dtype, float32 or bf16");
}

template <typename F>
static void dispatch(const torch::Tensor& t, const char* op, F&& body) {
  if (t.scalar_type() == at::kBFloat16) return body(BFloat16{});
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, " takes float32 or bf16, got ", t.scalar_type());
  body(float{});
}

// residual = x + residual; x = weight * rms_norm(residual), both in place ([T, hidden]).
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  for (const auto* t : {&x, &residual, &weight}) check(*t, x.scalar_type(), "add_rms_norm");
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t rows = x.size(0), dim = x.size(1);
    scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* rs = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        scalar_t* xr = xs + t * dim;
        scalar_t* rr = rs + t * dim;
        float squares = 0.f;
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; ++d) {
          rr[d] = narrowed<scalar_t>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
          squares += static_cast<float>(rr[d]) * static_cast<float>(rr[d]);
        }
        const float inv = 1.f / std::sqrt(squares / dim + static_cast<float>(eps));
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d)
          xr[d] = narrowed<scalar_t>(static_cast<float>(w[d]) * rounded<scalar_t>(static_cast<float>(rr[d]) * inv));
      }
    });
  });
}

// Rotary embedding (rotate-half layout) of the query and key heads of qkv ([T, (H + 2 Hkv) * D],
// in place); cos and sin are [T, D].
void rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads) {
  for (const auto* t : {&qkv, &cos, &sin}) check(*t, qkv.scalar_type(), "rotary");
  dispatch(qkv, "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t rows = qkv.size(0), width = qkv.size(1), dim = cos.size(1), half = dim / 2;
    scalar_t* data = qkv.data_ptr<scalar_t>();
    const scalar_t* cs = cos.data_ptr<scalar_t>();
    const scalar_t* sn = sin.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* c = cs + t * dim;
        const scalar_t* s = sn + t * dim;
        for (int64_t h = 0; h < heads + kv_heads; ++h) {
          scalar_t* x = data + t * width + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < half; ++d) {
            const float lo = x[d], hi = x[d + half];
            // x * cos + rotate_half(x) * sin, rounded after each product and the sum, as PyTorch does
            x[d] = narrowed<scalar_t>(rounded<scalar_t>(lo * static_cast<float>(c[d])) +
                                      rounded<scalar_t>(-hi * static_cast<float>(s[d])));
            x[d + half] = narrowed<scalar_t>(rounded<scalar_t>(hi * static_cast<float>(c[d + half])) +
                                             rounded<scalar_t>(lo * static_cast<float>(s[d + half])));
          }
        }
      }
    });
  });
}

#if defined(__AVX512F__)
// Sixteen values in and out of float32 lanes, and PyTorch's rounding of an intermediate.
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline __m512 rounded16(const float*, __m512 v) { return v; }
#endif
#if defined(__AVX512BF16__)
static inline __m512 widen(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }
static inline __m512 load16(const BFloat16* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline void store16(BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));  // to nearest even
}
static inline __m512 rounded16(const BFloat16*, __m512 v) { return widen((__m256i)_mm512_cvtneps_pbh(v)); }
#endif

// silu(gate) * up of gate_up ([T, 2 I]) -> [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, gate_up.scalar_type(), "silu_mul");
  const int64_t rows = gate_up.size(0), inner = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inner}, gate_up.options());
  dispatch(gate_up, "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
#if defined(__AVX512BF16__)
    constexpr bool vectorized = true;
#elif defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    constexpr bool vectorized = std::is_same_v<scalar_t, float>;
#else
    constexpr bool vectorized = false;
#endif
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* g = in + t * 2 * inner;
        const scalar_t* u = g + inner;
        scalar_t* ot = o + t * inner;
        int64_t i = 0;
#if defined(__AVX512F__)
        if constexpr (vectorized) {
          // silu(x) = x * sigmoid(x), the sigmoid from exp(-|x|) so that it never overflows.
          const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
          for (; i + 16 <= inner; i += 16) {
            const __m512 x = load16(g + i), e = exp512_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(x)));
            const __m512 numerator = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one, e);
            const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(one, e));
            store16(ot + i, _mm512_mul_ps(rounded16(g, _mm512_mul_ps(x, sigmoid)), load16(u + i)));
          }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (vectorized) {  // the same in eight lanes (std::exp does not vectorize)
          const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
          for (; i + 8 <= inner; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i), e = exp256_nonpositive(_mm256_or_ps(x, sign));
            const __m256 numerator = _mm256_blendv_ps(one, e, _mm256_cmp_ps(x, zero, _CMP_LT_OQ));
            const __m256 sigmoid = _mm256_div_ps(numerator, _mm256_add_ps(one, e));
            _mm256_storeu_ps(ot + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid), _mm256_loadu_ps(u + i)));
          }
        }
#endif
        for (; i < inner; ++i) {
          const float x = g[i];
          ot[i] = narrowed<scalar_t>(rounded<scalar_t>(x / (1.f + std::exp(-x))) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}
