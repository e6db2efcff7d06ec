// Exact attention read straight from the paged KV cache, for CPUs.
//
// One work item per query token: it reads its sequence's keys and values once, block by block
// through the block table, for all query heads (GQA: heads share their KV head's rows), with a
// numerically safe two-pass softmax in float32. Token t of sequence s at absolute
// position p sees keys 0..p (causal, and a chunk after cached tokens sees all of them).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "vec_exp.h"

#if defined(__AVX2__)
#include <immintrin.h>

// The rows of slots [j0, j1) asked for ahead of their use, keys for the scores' pass, values for
// the weighted sums': the blocks are scattered, so no hardware prefetcher guesses the next slots.
template <typename scalar_t>
static inline void prefetch_rows(const scalar_t* key_cache, const scalar_t* value_cache, const int64_t* slots,
                                 int64_t j0, int64_t j1, int64_t slot_stride) {
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t byte = 0; byte < slot_stride * int64_t(sizeof(scalar_t)); byte += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(key_cache + slots[j] * slot_stride) + byte, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(value_cache + slots[j] * slot_stride) + byte, _MM_HINT_T1);
    }
}
#endif

#if defined(__AVX512F__)
// Sixteen vectors in, one out: lane i holds the sum of v[i]'s lanes. Four rounds of pairing
// (45 instructions) instead of sixteen horizontal sums.
static inline __m512 sum_lanes16(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xdd));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
}

// How the AVX-512 passes read a cache's rows: the query's form for the dot products, one step of
// a dot product, and sixteen values of a row in float32.
struct Float32Rows {
  using scalar_t = float;
  using Query = __m512;
  static constexpr int64_t kStep = 16;  // elements of a row per dot product step
  static Query query(const float* q) { return _mm512_loadu_ps(q); }
  static __m512 dot(__m512 acc, Query q, const float* k) { return _mm512_fmadd_ps(q, _mm512_loadu_ps(k), acc); }
  static __m512 widen(const float* v) { return _mm512_loadu_ps(v); }
};

#if defined(__AVX512BF16__)
// bf16 pairs multiplied in VDPBF16PS (exact products, float32 sums) with no widening of the keys;
// the query is a bf16 model's, so it converts exactly. A value row is widened by a shift.
struct Bf16Rows {
  using scalar_t = at::BFloat16;
  using Query = __m512bh;
  static constexpr int64_t kStep = 32;
  static Query query(const float* q) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)); }
  static __m512 dot(__m512 acc, Query q, const at::BFloat16* k) {
    return _mm512_dpbf16_ps(acc, q, (__m512bh)_mm512_loadu_si512(k));
  }
  static __m512 widen(const at::BFloat16* v) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v))), 16));
  }
};
#endif

// Pass 1 on AVX-512: sixteen slots at a time, every head over them, each score's products summed
// in a register of its own and the sixteen reduced together by `sum_lanes16`, rather than one
// horizontal sum a score. The sixteen rows stay in L1 while the heads read them.
template <typename Rows, int64_t D>
static void scores512(const float* q, const typename Rows::scalar_t* key_cache,
                      const typename Rows::scalar_t* value_cache, const int64_t* slots, int64_t len, int64_t heads,
                      int64_t kv_heads, float scale, float* scores) {
  constexpr int64_t kSteps = D / Rows::kStep;
  const int64_t group = heads / kv_heads, slot_stride = kv_heads * D;
  std::vector<typename Rows::Query> qs(heads * kSteps);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t p = 0; p < kSteps; ++p) qs[h * kSteps + p] = Rows::query(q + h * D + Rows::kStep * p);
  for (int64_t j0 = 0; j0 < len; j0 += 16) {
    const typename Rows::scalar_t* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = key_cache + slots[std::min(j0 + i, len - 1)] * slot_stride;
    const __mmask16 valid = (1u << std::min<int64_t>(16, len - j0)) - 1;  // past the end: a repeat, not stored
    prefetch_rows(key_cache, value_cache, slots, j0 + 16, std::min(j0 + 32, len), slot_stride);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = h / group * D;
      __m512 acc[16];
      for (int64_t i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < kSteps; ++p)
          acc[i] = Rows::dot(acc[i], qs[h * kSteps + p], rows[i] + offset + Rows::kStep * p);
      }
      _mm512_mask_storeu_ps(scores + h * len + j0, valid, _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
    }
  }
}

// Pass 3 on AVX-512: a KV head's value rows (at `offset` in each slot) weighted for its G query
// heads from h0 on, whose G x D/16 float32 sums stay in registers; each row read (and widened) once.
template <typename Rows, int64_t D, int64_t G>
static void values512(const float* scores, const typename Rows::scalar_t* value_cache, const int64_t* slots,
                      int64_t len, int64_t slot_stride, int64_t offset, int64_t h0, float* out) {
  constexpr int64_t kRegs = D / 16;
  __m512 acc[G][kRegs];
  for (int64_t k = 0; k < G; ++k)
    for (int64_t r = 0; r < kRegs; ++r) acc[k][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const typename Rows::scalar_t* v = value_cache + slots[j] * slot_stride + offset;
    __m512 row[kRegs];
    for (int64_t r = 0; r < kRegs; ++r) row[r] = Rows::widen(v + 16 * r);
    for (int64_t k = 0; k < G; ++k) {
      const __m512 w = _mm512_set1_ps(scores[(h0 + k) * len + j]);
      for (int64_t r = 0; r < kRegs; ++r) acc[k][r] = _mm512_fmadd_ps(w, row[r], acc[k][r]);
    }
  }
  for (int64_t k = 0; k < G; ++k)
    for (int64_t r = 0; r < kRegs; ++r) _mm512_storeu_ps(out + (h0 + k) * D + 16 * r, acc[k][r]);
}

// The row type the AVX-512 passes read a cache of scalar_t with; void: the generic loops serve it.
template <typename scalar_t> struct Avx512Rows { using type = void; };
template <> struct Avx512Rows<float> { using type = Float32Rows; };
#if defined(__AVX512BF16__)
template <> struct Avx512Rows<at::BFloat16> { using type = Bf16Rows; };
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define AVX2_FLOAT32 1  // a float32 cache on an AVX2 CPU: passes 1 and 3 in 8-lane registers
// Eight vectors in, one out: lane i holds the sum of v[i]'s lanes.
static inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a: v0..v3's sums over their low halves, then over their high halves; b: v4..v7's
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// Pass 1 for a float32 cache on AVX2: eight slots at a time, every head over them, each score's
// products summed in a register of its own and the eight registers reduced together, rather than
// one horizontal sum a score. The eight rows stay in L1 while the heads read them.
template <int64_t D>
static void f32_scores(const float* q, const float* key_cache, const float* value_cache, const int64_t* slots,
                       int64_t len, int64_t heads, int64_t kv_heads, float scale, float* scores) {
  const int64_t group = heads / kv_heads, slot_stride = kv_heads * D;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const float* rows[8];
    for (int64_t i = 0; i < 8; ++i) rows[i] = key_cache + slots[std::min(j0 + i, len - 1)] * slot_stride;
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(8, len - j0))), lane);
    prefetch_rows(key_cache, value_cache, slots, j0 + 8, std::min(j0 + 16, len), slot_stride);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = h / group * D;
      __m256 acc[8];
      for (int64_t i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + h * D + d);
        for (int64_t i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(rows[i] + offset + d), acc[i]);
      }
      _mm256_maskstore_ps(scores + h * len + j0, valid, _mm256_mul_ps(sum_lanes8(acc), _mm256_set1_ps(scale)));
    }
  }
}

// Pass 3 for a float32 cache on AVX2: a KV head's value rows weighted for its G query heads from
// h0 on, C of the row's eight-float chunks at a time, so that the G x C sums and the G weights
// stay in AVX2's sixteen registers.
template <int64_t D, int64_t G>
static void f32_values(const float* scores, const float* value_cache, const int64_t* slots, int64_t len,
                       int64_t slot_stride, int64_t offset, int64_t h0, float* out) {
  constexpr int64_t C = G == 1 ? 8 : G <= 3 ? 4 : 2;
  for (int64_t c0 = 0; c0 < D / 8; c0 += C) {
    __m256 acc[G][C];
    for (int64_t k = 0; k < G; ++k)
      for (int64_t c = 0; c < C; ++c) acc[k][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* v = value_cache + slots[j] * slot_stride + offset + 8 * c0;
      __m256 w[G];
      for (int64_t k = 0; k < G; ++k) w[k] = _mm256_broadcast_ss(scores + (h0 + k) * len + j);
      for (int64_t c = 0; c < C; ++c) {
        const __m256 row = _mm256_loadu_ps(v + 8 * c);
        for (int64_t k = 0; k < G; ++k) acc[k][c] = _mm256_fmadd_ps(w[k], row, acc[k][c]);
      }
    }
    for (int64_t k = 0; k < G; ++k)
      for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(out + (h0 + k) * D + 8 * (c0 + c), acc[k][c]);
  }
}
#endif

// Normalized exponentials of s[0..len), in place, shifted by their max.
static void softmax(float* s, int64_t len) {
#if defined(__AVX512F__)
  const auto tail = [&](int64_t j) { return (__mmask16)((1u << std::min<int64_t>(16, len - j)) - 1); };
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; j += 16) m = _mm512_mask_max_ps(m, tail(j), m, _mm512_maskz_loadu_ps(tail(j), s + j));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __m512 x = exp512_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail(j), s + j), max));
    sum = _mm512_mask_add_ps(sum, tail(j), sum, x);
    _mm512_mask_storeu_ps(s + j, tail(j), x);
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < len; j += 16)
    _mm512_mask_storeu_ps(s + j, tail(j), _mm512_mul_ps(_mm512_maskz_loadu_ps(tail(j), s + j), inv));
#elif defined(AVX2_FLOAT32)
  const int64_t whole = len / 8 * 8;
  alignas(32) float lanes[8];
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < whole; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  _mm256_store_ps(lanes, m);
  float max = *std::max_element(lanes, lanes + 8);
  for (int64_t j = whole; j < len; ++j) max = std::max(max, s[j]);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < whole; j += 8) {
    const __m256 x = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(max)));
    sum = _mm256_add_ps(sum, x);
    _mm256_storeu_ps(s + j, x);
  }
  _mm256_store_ps(lanes, sum);
  float total = std::accumulate(lanes, lanes + 8, 0.f);
  for (int64_t j = whole; j < len; ++j) total += s[j] = exp_nonpositive(s[j] - max);
  const float inv = 1.f / total;
  for (int64_t j = 0; j < whole; j += 8) _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(inv)));
  for (int64_t j = whole; j < len; ++j) s[j] *= inv;
#else
  const float max = *std::max_element(s, s + len);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < len; ++j) {
    s[j] = exp_nonpositive(s[j] - max);
    sum += s[j];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t j = 0; j < len; ++j) s[j] *= inv;
#endif
}

constexpr int64_t kMaxGroup = 4;  // query heads per KV head whose value sums are kept at once

// Attention of one query token (all its heads) over keys 0..position of its sequence, reading
// the cache through the sequence's block table: `slots` (scratch) gets the cache slot of each
// position first, so that no pass divides by the block size.
// With an int8 cache, `k_scales`/`v_scales` hold one float per (slot, KV head); else they are null.
template <typename scalar_t, int64_t D>
static void attend(const float* q, const scalar_t* key_cache, const scalar_t* value_cache, const float* k_scales,
                   const float* v_scales, const int64_t* table, int64_t position, int64_t heads, int64_t kv_heads,
                   int64_t block_size, float scale, std::vector<float>& scores, std::vector<int64_t>& slots,
                   float* out) {
  const int64_t len = position + 1, group = heads / kv_heads, slot_stride = kv_heads * D;
  scores.resize(heads * len);
  slots.resize(len);
  for (int64_t b = 0, j = 0; j < len; ++b)
    for (int64_t i = 0; i < block_size && j < len; ++i, ++j) slots[j] = table[b] * block_size + i;
  float row[D];
  // Pass 1: scores.
#if defined(__AVX512F__)
  using Rows = typename Avx512Rows<scalar_t>::type;
  if constexpr (!std::is_void_v<Rows>) {
    scores512<Rows, D>(q, key_cache, value_cache, slots.data(), len, heads, kv_heads, scale, scores.data());
  } else
#endif
#if defined(AVX2_FLOAT32)
  if constexpr (std::is_same_v<scalar_t, float>) {
    f32_scores<D>(q, key_cache, value_cache, slots.data(), len, heads, kv_heads, scale, scores.data());
  } else
#endif
  // Every head of a slot at once (the slot's rows are contiguous). Each KV head's row is widened
  // to float32 once, in its own vectorized loop, for the query heads that share it (converting
  // inside the dot product kept bf16 from vectorizing: twice float32's time).
  for (int64_t j = 0; j < len; ++j) {
    const float* k_scale = k_scales ? k_scales + slots[j] * kv_heads : nullptr;
    for (int64_t g = 0; g < kv_heads; ++g) {
      const scalar_t* k = key_cache + slots[j] * slot_stride + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(k[d]);
      const float row_scale = scale * (k_scale ? k_scale[g] : 1.f);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = q + h * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qh[d] * row[d];
        scores[h * len + j] = acc * row_scale;
      }
    }
  }
  // Pass 2: softmax per head.
  for (int64_t h = 0; h < heads; ++h) softmax(scores.data() + h * len, len);
  // Pass 3: weighted values, one KV head at a time: its row is widened once for the query heads
  // that share it, up to kMaxGroup of them at once.
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kMaxGroup) {
      const int64_t n = std::min<int64_t>(kMaxGroup, (g + 1) * group - h0);
#if defined(__AVX512F__)
      if constexpr (!std::is_void_v<Rows>) {
        constexpr decltype(&values512<Rows, D, 1>) kValues[kMaxGroup] = {
            values512<Rows, D, 1>, values512<Rows, D, 2>, values512<Rows, D, 3>, values512<Rows, D, 4>};
        kValues[n - 1](scores.data(), value_cache, slots.data(), len, slot_stride, g * D, h0, out);
        continue;
      }
#endif
#if defined(AVX2_FLOAT32)
      if constexpr (std::is_same_v<scalar_t, float>) {
        constexpr decltype(&f32_values<D, 1>) kValues[kMaxGroup] = {f32_values<D, 1>, f32_values<D, 2>,
                                                                    f32_values<D, 3>, f32_values<D, 4>};
        kValues[n - 1](scores.data(), value_cache, slots.data(), len, slot_stride, g * D, h0, out);
        continue;
      }
#endif
      float acc[kMaxGroup][D] = {};
      for (int64_t j = 0; j < len; ++j) {
        const scalar_t* v = value_cache + slots[j] * slot_stride + g * D;
        const float v_scale = v_scales ? v_scales[slots[j] * kv_heads + g] : 1.f;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = static_cast<float>(v[d]) * v_scale;
        for (int64_t k = 0; k < n; ++k) {
          const float wj = scores[(h0 + k) * len + j];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[k][d] += wj * row[d];
        }
      }
      for (int64_t k = 0; k < n; ++k) std::copy(acc[k], acc[k] + D, out + (h0 + k) * D);
    }
  }
}

// query [T, H, D] float32; caches [N, block_size, Hkv, D]; scales: [2, N, block_size, Hkv] float32 for
// int8 caches, else empty; block_tables [T, max_blocks] int64 (the table of each token's sequence);
// positions [T] int64 (each token's absolute position).
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor positions,
                              double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.is_contiguous(), "query must be contiguous float32");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && positions.dtype() == torch::kInt64, "indices must be int64");
  const int64_t tokens = query.size(0), heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", head_dim);
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 4),
              "an int8 cache needs float32 scales [2, N, block_size, Hkv]");
  const float* k_scales = int8 ? scales.data_ptr<float>() : nullptr;
  const float* v_scales = int8 ? k_scales + scales[0].numel() : nullptr;
  // Tokens in the order of their first block: those whose sequences share a cached prefix run one
  // after another on one thread, which then reads the prefix's rows from its own L2 cache.
  std::vector<int64_t> order(tokens);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tables[a * max_blocks] < tables[b * max_blocks]; });
  auto run = [&](auto* kc, auto* vc) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    auto one = head_dim == 64 ? attend<scalar_t, 64> : attend<scalar_t, 128>;
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      std::vector<int64_t> slots;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = order[i];
        one(q + t * heads * head_dim, kc, vc, k_scales, v_scales, tables + t * max_blocks, pos[t], heads, kv_heads,
            block_size, static_cast<float>(scale), scores, slots, o + t * heads * head_dim);
      }
    });
  };
  if (int8) {
    run(key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "paged_attention", [&] {
      run(key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>());
    });
  }
  return out;
}
