// Linear layers on GGUF-quantized weights, y = x @ W^T, W kept in ggml's block formats (the layouts
// of ggml-common.h): Q8_0, Q4_0, Q4_1 (blocks of 32 elements) and Q4_K, Q6_K (super-blocks of 256).
//
// A decode step is bound by the weight bytes it reads, so the weight is never widened in memory: as
// llama.cpp does, x's rows are quantized to int8 first (a scale per 32 elements for the 32-element
// types, per 256 for the K-quants, whose integer sub-block scales then apply before any float
// multiply), and each block's dot product is an integer one: VPDPBUSD (AVX512-VNNI) or VPMADDUBSW
// (AVX-512BW, AVX2) of the weight's unsigned 4- or 6-bit values against x's signed bytes. The blocks'
// offsets (Q4_0's -8, Q4_1's min, Q4_K's mins, Q6_K's -32) come from x's per-block sums, once per
// block rather than per element. With AVX-512 two 32-element blocks share a register, and float
// sums stay in 16 lanes until a weight row ends. Each weight row is decoded once for up to 8 rows of
// x, and a tile of weight rows stays in cache while every group of 8 rows passes over it.
//
// From 16 rows of bf16 x on (a batch of decode tokens, a prompt), where AVX512-BF16 is built, the
// weight is dequantized to bf16 a slice of rows at a time instead and multiplied by bf16 GEMMs (the
// native tiles of bf16_tiles.h, or from 32 rows oneDNN's), which then outrun the integer kernels
// (each of their products pays for its block's float scale).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__) && defined(__FMA__)
#define QUANT_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define QUANT_AVX2 1
#endif
#if defined(QUANT_AVX512) || defined(QUANT_AVX2) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "bf16_tiles.h"

namespace {

// ggml's type ids (gguf's GGMLQuantizationType)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int64_t kGroup = 8;      // rows of x per pass over a weight row
constexpr int64_t kTileRows = 16;  // weight rows per work item

struct Layout {
  int64_t elements, bytes;  // per block
};

Layout layout_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};   // fp16 d, 16 bytes of nibbles: element i low, i + 16 high; d * (q - 8)
    case kQ4_1: return {32, 20};   // fp16 d, fp16 m, 16 bytes of nibbles as Q4_0's; d * q + m
    case kQ8_0: return {32, 34};   // fp16 d, 32 int8; d * q
    case kQ4_K: return {256, 144}; // fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    case kQ6_K: return {256, 210}; // 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
  }
  TORCH_CHECK(false, "quant_linear: ggml type ", type, " is not served (Q4_0, Q4_1, Q8_0, Q4_K and Q6_K are)");
}

bool k_quant(int64_t type) { return type == kQ4_K || type == kQ6_K; }

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K's 8 scales and 8 mins (6 bits each) from its 12 bytes: bytes 0-3 hold scales 0-3 and, in their
// top 2 bits, the top bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits
// of scales 4-7 (low nibbles) and mins 4-7 (high nibbles). Out: the 16 values as bytes, scales first.
inline void k_scales(const uint8_t* p, uint32_t out[4]) {
  const uint32_t scales = load32(p), mins = load32(p + 4), low = load32(p + 8);
  out[0] = scales & 0x3F3F3F3F;
  out[1] = (low & 0x0F0F0F0F) | ((scales >> 2) & 0x30303030);
  out[2] = mins & 0x3F3F3F3F;
  out[3] = ((low >> 4) & 0x0F0F0F0F) | ((mins >> 2) & 0x30303030);
}

// Q4_K's element e (of 256): sub-block j = e / 32 (8 of them) takes the low nibbles (even j) or the
// high ones (odd j) of the 32 bytes 32 (j / 2) after the 16-byte header.
inline int q4_k_value(const uint8_t* b, int e) {
  const int j = e / 32;
  return (b[16 + 32 * (j / 2) + e % 32] >> (4 * (j % 2))) & 15;
}

// Q6_K's element e (of 256, value - 32 times the scale of e / 16): in each half of 128, the low 4
// bits of elements 0-63 are the low nibbles of its 64 bytes of `ql`, of 64-127 the high ones; the top
// 2 bits of elements 32 s + l are bits 2 s and 2 s + 1 of the l-th of its 32 bytes of `qh`.
inline int q6_k_value(const uint8_t* b, int e) {
  const int h = e / 128, s = e % 128 / 32, l = e % 32;
  const int low = (b[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 15;
  const int high = (b[128 + 32 * h + l] >> (2 * s)) & 3;
  return low | high << 4;
}

// The element values of one block, as gguf's dequantizers define them.
void dequantize_block(int64_t type, const uint8_t* b, float* y) {
  switch (type) {
    case kQ8_0: {
      const float d = fp16(b);
      for (int i = 0; i < 32; ++i) y[i] = d * static_cast<int8_t>(b[2 + i]);
      break;
    }
    case kQ4_0:
    case kQ4_1: {
      const bool q4_1 = type == kQ4_1;
      const float d = fp16(b), m = q4_1 ? fp16(b + 2) : -8.0f * d;
      const uint8_t* q = b + (q4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * (q[i] & 15) + m;
        y[i + 16] = d * (q[i] >> 4) + m;
      }
      break;
    }
    case kQ4_K: {
      const float d = fp16(b), dmin = fp16(b + 2);
      uint32_t packed[4];
      k_scales(b + 4, packed);
      const uint8_t* scales = reinterpret_cast<const uint8_t*>(packed);
      for (int e = 0; e < 256; ++e) y[e] = d * scales[e / 32] * q4_k_value(b, e) - dmin * scales[8 + e / 32];
      break;
    }
    case kQ6_K: {
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = fp16(b + 208);
      for (int e = 0; e < 256; ++e) y[e] = d * scales[e / 16] * (q6_k_value(b, e) - 32);
      break;
    }
  }
}

#if defined(QUANT_AVX512)
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
#if defined(__AVX512BF16__)
inline void store16(at::BFloat16* y, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

inline __m512 unsigned16(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// A row of K values, 16 at a time: scale * q + offset per run of 16 that share them.
template <typename Out>
void dequantize_row(int64_t type, const uint8_t* w, int64_t K, Out* y) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  auto put = [&](Out* at, float scale, __m128i q, float offset) {
    store16(at, _mm512_fmadd_ps(_mm512_set1_ps(scale), unsigned16(q), _mm512_set1_ps(offset)));
  };
  switch (type) {
    case kQ8_0:
      for (int64_t b = 0; b < K / 32; ++b, w += 34, y += 32)
        for (int h = 0; h < 2; ++h)
          store16(y + 16 * h, _mm512_mul_ps(_mm512_set1_ps(fp16(w)),
                                            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(w + 2 + 16 * h)))));
      break;
    case kQ4_0:
    case kQ4_1: {
      const int64_t bytes = type == kQ4_1 ? 20 : 18;
      for (int64_t b = 0; b < K / 32; ++b, w += bytes, y += 32) {
        const float d = fp16(w), m = type == kQ4_1 ? fp16(w + 2) : -8.0f * d;
        const __m128i q = load16(w + bytes - 16);
        put(y, d, _mm_and_si128(q, low4), m);
        put(y + 16, d, _mm_and_si128(_mm_srli_epi16(q, 4), low4), m);
      }
      break;
    }
    case kQ4_K:
      for (int64_t sb = 0; sb < K / 256; ++sb, w += 144, y += 256) {
        const float d = fp16(w), dmin = fp16(w + 2);
        uint32_t packed[4];
        k_scales(w + 4, packed);
        const uint8_t* scales = reinterpret_cast<const uint8_t*>(packed);
        for (int j = 0; j < 8; ++j)
          for (int i = 0; i < 2; ++i) {
            const __m128i q = load16(w + 16 + 32 * (j / 2) + 16 * i);
            put(y + 32 * j + 16 * i, d * scales[j], _mm_and_si128(j % 2 ? _mm_srli_epi16(q, 4) : q, low4),
                -dmin * scales[8 + j]);
          }
      }
      break;
    case kQ6_K:
      for (int64_t sb = 0; sb < K / 256; ++sb, w += 210, y += 256) {
        const float d = fp16(w + 208);
        for (int g = 0; g < 16; ++g) {  // elements 16 g...: see q6_k_value
          const int h = g / 8, s = g % 8 / 2, l = g % 2 * 16;
          const __m128i ql = load16(w + 64 * h + 32 * (s & 1) + l);
          const __m128i low = _mm_and_si128(s < 2 ? ql : _mm_srli_epi16(ql, 4), low4);
          const __m128i high = _mm_and_si128(_mm_srl_epi16(load16(w + 128 + 32 * h + l), _mm_cvtsi32_si128(2 * s)),
                                             _mm_set1_epi8(3));
          const float scale = d * static_cast<int8_t>(w[192 + g]);
          put(y + 16 * g, scale, _mm_or_si128(low, _mm_slli_epi16(high, 4)), -32.0f * scale);
        }
      }
      break;
  }
}
#else
void dequantize_row(int64_t type, const uint8_t* w, int64_t K, float* y) {
  const Layout layout = layout_of(type);
  for (int64_t b = 0; b < K / layout.elements; ++b) dequantize_block(type, w + b * layout.bytes, y + b * layout.elements);
}
#endif

// x's rows quantized: int8 values with a float scale per block (32 elements, or 256 for the
// K-quants) and the blocks' sums, in the forms the kernels below take.
struct QuantizedRows {
  int64_t blocks = 0, stride = 0;  // per row: blocks, and bytes of `values` (whole pairs of blocks)
  std::vector<int8_t> values;
  std::vector<float> scales;   // [row][block]
  std::vector<float> sums;     // 32-element types: [row][block], scale * (sum of the block's values)
  std::vector<int16_t> sums16; // K-quants: [row][K / 16], the sums of each 16 values
#if defined(QUANT_AVX512)
  std::vector<float> pair_terms;  // 32-element types: [row][pair][4], see `fill_pair_terms`
#endif
};

// One block of n values as int8 (round to nearest) and their scale, max |x| / 127.
template <typename T>
inline float quantize_block(const T* x, int n, int8_t* q) {
  float values[256];
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    values[i] = static_cast<float>(x[i]);
    amax = std::max(amax, std::fabs(values[i]));
  }
  // below 1e-30 (where 127 / max may overflow) a block counts as zeros
  const float inverse = amax >= 1e-30f ? 127.0f / amax : 0.0f;
  for (int i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(values[i] * inverse));
  return amax / 127.0f;
}

#if defined(QUANT_AVX512)
// Per pair of blocks, the 4 floats that multiply the weight's 4 scales (as dot_blocks reads them):
// x's scales where they meet the weight's d's, and where Q4_0 repeats its d's (for -8 d) or Q4_1
// has its mins, x's sums (scale times the sum of the block's values), times -8 for Q4_0.
void fill_pair_terms(int64_t type, QuantizedRows& x, int64_t row) {
  const int64_t pairs = x.stride / 64;
  float* terms = x.pair_terms.data() + row * pairs * 4;
  const float *scales = x.scales.data() + row * x.blocks, *sums = x.sums.data() + row * x.blocks;
  std::fill(terms, terms + pairs * 4, 0.0f);  // an odd last block's partner stays 0
  for (int64_t b = 0; b < x.blocks; ++b) {
    float* pair = terms + (b / 2) * 4;
    const int64_t i = b % 2;
    if (type == kQ4_1) {  // [d0, m0, d1, m1]
      pair[2 * i] = scales[b];
      pair[2 * i + 1] = sums[b];
    } else {  // [d0, d1, d0, d1]
      pair[i] = scales[b];
      pair[2 + i] = type == kQ4_0 ? -8.0f * sums[b] : 0.0f;
    }
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int64_t type, QuantizedRows& out) {
  const int64_t block = k_quant(type) ? 256 : 32;
  out.blocks = K / block;
  out.stride = k_quant(type) ? K : (out.blocks + 1) / 2 * 64;
  out.values.assign(M * out.stride, 0);
  out.scales.resize(M * out.blocks);
  out.sums.resize(k_quant(type) ? 0 : M * out.blocks);
  out.sums16.resize(k_quant(type) ? M * K / 16 : 0);
#if defined(QUANT_AVX512)
  out.pair_terms.resize(k_quant(type) ? 0 : M * out.stride / 16);
#endif
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = out.values.data() + m * out.stride;
      for (int64_t b = 0; b < out.blocks; ++b) {
        const float d = quantize_block(x + m * K + b * block, block, q + b * block);
        out.scales[m * out.blocks + b] = d;
        if (k_quant(type)) continue;
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += q[b * 32 + i];
        out.sums[m * out.blocks + b] = d * sum;
      }
      if (k_quant(type))
        for (int64_t g = 0; g < K / 16; ++g) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += q[g * 16 + i];
          out.sums16[m * K / 16 + g] = static_cast<int16_t>(sum);
        }
#if defined(QUANT_AVX512)
      else
        fill_pair_terms(type, out, m);
#endif
    }
  });
}

// A kernel: the dot products of one weight row with R rows of x, from `row0` on.
using Kernel = void (*)(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* sums);

#if defined(QUANT_AVX512)

inline __m512i dot_u8s8(__m512i u, __m512i s) {  // 16 sums of 4 products of unsigned and signed bytes
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

// Two blocks' 16 bytes of nibbles as 64 bytes in element order: low nibbles then high ones, each block.
inline __m512i nibbles(const uint8_t* q0, const uint8_t* q1) {
  const __m512i both = _mm512_mask_broadcast_i64x2(
      _mm512_broadcast_i64x2(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0))), 0xF0,
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)));
  return _mm512_and_si512(_mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)), _mm512_set1_epi8(0x0F));
}

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

// Q8_0, Q4_0, Q4_1 over pairs of blocks: a pair's 16 integer sums (8 a block) times their block's
// two scales, spread over their lanes from 4 products of the weight's and x's scales, which also
// hold the blocks' offsets (Q4_0's -8 d, Q4_1's min, times x's sums), summed in 4 lanes apart.
template <int64_t T, int R>
void dot_blocks(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  constexpr int64_t bytes = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : 20, header = T == kQ4_1 ? 4 : 2;
  const int64_t pairs = x.stride / 64;
  // lanes 0-7 from product 0, 8-15 from product 1 (Q4_1: 2)
  const __m512i spread = T == kQ4_1 ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                    : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc[R];
  __m128 offsets[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), offsets[r] = _mm_setzero_ps();
  auto pair = [&](int64_t p, const uint8_t* b0, const uint8_t* b1) {
    __m128 scales;
    __m512i wq;
    if constexpr (T == kQ4_1) {  // [d0, m0, d1, m1]
      scales = _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(load32(b0)), _mm_cvtsi32_si128(load32(b1))));
    } else {  // [d0, d1, d0, d1]
      const __m128i d = _mm_unpacklo_epi16(_mm_cvtsi32_si128(load32(b0)), _mm_cvtsi32_si128(load32(b1)));
      scales = _mm_cvtph_ps(_mm_unpacklo_epi32(d, d));
    }
    if constexpr (T == kQ8_0) {
      wq = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b0 + 2))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b1 + 2)), 1);
    } else {
      wq = nibbles(b0 + header, b1 + header);
    }
    // Q8_0's signed weights: their magnitudes against x's values with the weights' signs
    const __mmask64 negative = T == kQ8_0 ? _mm512_movepi8_mask(wq) : 0;
    if constexpr (T == kQ8_0) wq = _mm512_abs_epi8(wq);
    for (int r = 0; r < R; ++r) {
      const __m128 products = _mm_mul_ps(scales, _mm_loadu_ps(x.pair_terms.data() + ((row0 + r) * pairs + p) * 4));
      __m512i xq = _mm512_loadu_si512(x.values.data() + (row0 + r) * x.stride + p * 64);
      if constexpr (T == kQ8_0) xq = _mm512_mask_sub_epi8(xq, negative, _mm512_setzero_si512(), xq);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_u8s8(wq, xq)),
                               _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(products)), acc[r]);
      if constexpr (T != kQ8_0) offsets[r] = _mm_add_ps(offsets[r], products);
    }
  };
  for (int64_t p = 0; p < x.blocks / 2; ++p) pair(p, w + 2 * p * bytes, w + (2 * p + 1) * bytes);
  if (x.blocks % 2) {  // the last block twice: x's terms for the second are 0
    const uint8_t* last = w + (x.blocks - 1) * bytes;
    pair(x.blocks / 2, last, last);
  }
  for (int r = 0; r < R; ++r) {
    // the offsets' lanes: Q4_0's 2 and 3, Q4_1's 1 and 3
    const __m128 o = offsets[r];
    const float offset = T == kQ4_0 ? _mm_cvtss_f32(_mm_add_ss(_mm_movehl_ps(o, o), _mm_movehdup_ps(_mm_movehl_ps(o, o))))
                         : T == kQ4_1 ? _mm_cvtss_f32(_mm_add_ss(_mm_movehdup_ps(o), _mm_movehl_ps(o, _mm_movehdup_ps(o))))
                                      : 0.0f;
    out[r] = reduce(acc[r]) + offset;
  }
}

// Index vectors of 32 int16 lanes that spread sub-block scales over the lanes of their sums: a
// Q4_K chunk of 64 elements holds sub-blocks 2c and 2c + 1 (16 lanes each), a Q6_K group of 64 four
// sub-blocks of 16 (8 lanes each).
struct ScaleIndex {
  std::array<std::array<int16_t, 32>, 4> q4_k{}, q6_k{};
  ScaleIndex() {
    for (int c = 0; c < 4; ++c)
      for (int lane = 0; lane < 32; ++lane) {
        q4_k[c][lane] = static_cast<int16_t>(2 * c + lane / 16);
        q6_k[c][lane] = static_cast<int16_t>(4 * c + lane / 8);
      }
  }
};
const ScaleIndex kScaleIndex;

inline __m512i scale_lanes(const std::array<int16_t, 32>& index, __m512i scales) {
  return _mm512_permutexvar_epi16(_mm512_loadu_si512(index.data()), scales);
}

// x's 64 values for a chunk against the weight's 64: pairs of products (VPMADDUBSW) summed in pairs
// times their sub-block's scale (VPMADDWD), so a super-block's integer sum needs no float multiply.
inline __m512i scaled_dot(__m512i wq, const int8_t* x, __m512i scales) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(wq, _mm512_loadu_si512(x)), scales);
}

template <int R>
void dot_q4_k(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  __m512 acc[R];
  __m256 mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), mins[r] = _mm256_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < x.blocks; ++sb) {
    const uint8_t* b = w + sb * 144;
    uint32_t packed[4];
    k_scales(b + 4, packed);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    const __m512i scales = _mm512_zextsi256_si512(_mm256_cvtepu8_epi16(bytes));
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes));  // each min twice: per 16 sums
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      const __m512i wq =
          _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1), low4);
      const __m512i sc = scale_lanes(kScaleIndex.q4_k[c], scales);
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_add_epi32(isum[r], scaled_dot(wq, x.values.data() + (row0 + r) * x.stride + sb * 256 + 64 * c, sc));
    }
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int r = 0; r < R; ++r) {
      const float dx = x.scales[(row0 + r) * x.blocks + sb];
      const __m256i sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.sums16.data() + (row0 + r) * x.blocks * 16 + sb * 16));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * dx), acc[r]);
      mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, sums)), _mm256_set1_ps(dmin * dx), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(_mm512_sub_ps(acc[r], _mm512_zextps256_ps512(mins[r])));
}

template <int R>
void dot_q6_k(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  for (int64_t sb = 0; sb < x.blocks; ++sb) {
    const uint8_t* b = w + sb * 210;
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    const __m512i scales = _mm512_zextsi256_si512(scales16);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) {  // every value's -32: -32 times the sum of each scale times x's sum under it
      const __m256i sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.sums16.data() + (row0 + r) * x.blocks * 16 + sb * 16));
      isum[r] = _mm512_zextsi256_si512(
          _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(scales16, sums), 5)));
    }
    for (int h = 0; h < 2; ++h) {
      // 128 elements: low 4 bits from 64 bytes (low nibbles, then high), top 2 bits from bits 0-1, 2-3,
      // 4-5, 6-7 of 32 bytes for each 32 elements in turn
      const __m512i ql = _mm512_loadu_si512(b + 64 * h);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m512i high = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
      const __m512i first = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                            _mm512_and_si512(_mm512_slli_epi16(high, 4), bits45));
      const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                             _mm512_and_si512(high, bits45));
      const __m512i sc0 = scale_lanes(kScaleIndex.q6_k[2 * h], scales);
      const __m512i sc1 = scale_lanes(kScaleIndex.q6_k[2 * h + 1], scales);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.values.data() + (row0 + r) * x.stride + sb * 256 + 128 * h;
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(scaled_dot(first, xr, sc0), scaled_dot(second, xr + 64, sc1)));
      }
    }
    const float d = fp16(b + 208);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * x.scales[(row0 + r) * x.blocks + sb]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(acc[r]);
}

#elif defined(QUANT_AVX2)

inline __m256i dot_u8s8(__m256i u, __m256i s) {  // 8 sums of 4 products of unsigned and signed bytes
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

inline float reduce(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Q8_0, Q4_0, Q4_1 a block at a time; the blocks' offsets (Q4_0's -8 d, Q4_1's m) times x's sums.
template <int64_t T, int R>
void dot_blocks(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  constexpr int64_t bytes = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : 20, header = T == kQ4_1 ? 4 : 2;
  __m256 acc[R];
  float offsets[R] = {};
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = w + b * bytes;
    const float dw = fp16(block), offset = T == kQ4_1 ? fp16(block + 2) : -8.0f * dw;
    __m256i wq;
    if constexpr (T == kQ8_0) {
      wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + header));
      wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
    }
    const __m256i magnitudes = T == kQ8_0 ? _mm256_abs_epi8(wq) : wq;  // Q8_0: against x with the weights' signs
    for (int r = 0; r < R; ++r) {
      const int64_t row = row0 + r;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.values.data() + row * x.stride + b * 32));
      if constexpr (T == kQ8_0) xq = _mm256_sign_epi8(xq, wq);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(magnitudes, xq)),
                               _mm256_set1_ps(dw * x.scales[row * x.blocks + b]), acc[r]);
      if constexpr (T != kQ8_0) offsets[r] += offset * x.sums[row * x.blocks + b];
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(acc[r]) + offsets[r];
}

// 32 values of x against the weight's 32, times their (one or two) sub-blocks' scales, 16-bit lanes.
inline __m256i scaled_dot(__m256i wq, const int8_t* x, __m256i scales) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wq, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), scales);
}

template <int R>
void dot_q4_k(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  __m256 acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t sb = 0; sb < x.blocks; ++sb) {
    const uint8_t* b = w + sb * 144;
    uint32_t packed[4];
    k_scales(b + 4, packed);
    const uint8_t* scales = reinterpret_cast<const uint8_t*>(packed);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed));
    const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(bytes, bytes));  // each min twice: per 16 sums
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * c));
      const __m256i low = _mm256_and_si256(q, low4), high = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      const __m256i sc_low = _mm256_set1_epi16(scales[2 * c]), sc_high = _mm256_set1_epi16(scales[2 * c + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.values.data() + (row0 + r) * x.stride + sb * 256 + 64 * c;
        isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(scaled_dot(low, xr, sc_low), scaled_dot(high, xr + 32, sc_high)));
      }
    }
    const float d = fp16(b), dmin = fp16(b + 2);
    for (int r = 0; r < R; ++r) {
      const float dx = x.scales[(row0 + r) * x.blocks + sb];
      const __m256i sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.sums16.data() + (row0 + r) * x.blocks * 16 + sb * 16));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
      mins[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, sums)), _mm256_set1_ps(dmin * dx), mins[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(_mm256_sub_ps(acc[r], mins[r]));
}

template <int R>
void dot_q6_k(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  for (int64_t sb = 0; sb < x.blocks; ++sb) {
    const uint8_t* b = w + sb * 210;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
    __m256i isum[R];
    for (int r = 0; r < R; ++r) {  // every value's -32: -32 times the sum of each scale times x's sum under it
      const __m256i sums = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x.sums16.data() + (row0 + r) * x.blocks * 16 + sb * 16));
      isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(scales16, sums), 5));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      // the top 2 bits of each 32 elements in turn, moved to bits 4-5
      const __m256i high[4] = {_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 2), qh, _mm256_srli_epi16(qh, 2)};
      for (int s = 0; s < 4; ++s) {
        const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (s & 1)));
        const __m256i low = _mm256_and_si256(s < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
        const __m256i wq = _mm256_or_si256(low, _mm256_and_si256(high[s], bits45));
        const int j = 8 * h + 2 * s;  // the two sub-blocks of 16
        const __m256i sc = _mm256_set_m128i(_mm_set1_epi16(scales[j + 1]), _mm_set1_epi16(scales[j]));
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(
              isum[r], scaled_dot(wq, x.values.data() + (row0 + r) * x.stride + sb * 256 + 128 * h + 32 * s, sc));
      }
    }
    const float d = fp16(b + 208);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.scales[(row0 + r) * x.blocks + sb]), acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = reduce(acc[r]);
}

#else

// The integer dot products of the vector kernels, an element at a time.
float dot_row(int64_t type, const uint8_t* w, const QuantizedRows& x, int64_t row) {
  const Layout layout = layout_of(type);
  const int8_t* xq = x.values.data() + row * x.stride;
  float sum = 0.0f;
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = w + b * layout.bytes;
    const int8_t* q = xq + b * layout.elements;
    const float dx = x.scales[row * x.blocks + b];
    int isum = 0;
    if (type == kQ8_0) {
      for (int i = 0; i < 32; ++i) isum += static_cast<int8_t>(block[2 + i]) * q[i];
      sum += fp16(block) * dx * isum;
    } else if (type == kQ4_0 || type == kQ4_1) {
      const uint8_t* nibbles = block + (type == kQ4_1 ? 4 : 2);
      for (int i = 0; i < 16; ++i) isum += (nibbles[i] & 15) * q[i] + (nibbles[i] >> 4) * q[i + 16];
      const float offset = type == kQ4_1 ? fp16(block + 2) : -8.0f * fp16(block);
      sum += fp16(block) * dx * isum + offset * x.sums[row * x.blocks + b];
    } else if (type == kQ4_K) {
      uint32_t packed[4];
      k_scales(block + 4, packed);
      const uint8_t* scales = reinterpret_cast<const uint8_t*>(packed);
      const int16_t* sums = x.sums16.data() + row * x.blocks * 16 + b * 16;
      int mins = 0;
      for (int e = 0; e < 256; ++e) isum += scales[e / 32] * q4_k_value(block, e) * q[e];
      for (int j = 0; j < 8; ++j) mins += scales[8 + j] * (sums[2 * j] + sums[2 * j + 1]);
      sum += dx * (fp16(block) * isum - fp16(block + 2) * mins);
    } else {
      const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
      for (int e = 0; e < 256; ++e) isum += scales[e / 16] * (q6_k_value(block, e) - 32) * q[e];
      sum += dx * fp16(block + 208) * isum;
    }
  }
  return sum;
}

#endif

template <int64_t T, int R>
void kernel(const uint8_t* w, const QuantizedRows& x, int64_t row0, float* out) {
#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
  if constexpr (T == kQ4_K) {
    dot_q4_k<R>(w, x, row0, out);
  } else if constexpr (T == kQ6_K) {
    dot_q6_k<R>(w, x, row0, out);
  } else {
    dot_blocks<T, R>(w, x, row0, out);
  }
#else
  for (int r = 0; r < R; ++r) out[r] = dot_row(T, w, x, row0 + r);
#endif
}

template <int64_t T, size_t... R>
constexpr std::array<Kernel, kGroup> kernels_of(std::index_sequence<R...>) { return {&kernel<T, R + 1>...}; }

template <int64_t T>
constexpr std::array<Kernel, kGroup> kKernels = kernels_of<T>(std::make_index_sequence<kGroup>{});

// The kernel of this type for `rows` rows of x (1 to kGroup).
Kernel kernel_for(int64_t type, int64_t rows) {
  switch (type) {
    case kQ4_0: return kKernels<kQ4_0>[rows - 1];
    case kQ4_1: return kKernels<kQ4_1>[rows - 1];
    case kQ8_0: return kKernels<kQ8_0>[rows - 1];
    case kQ4_K: return kKernels<kQ4_K>[rows - 1];
    default: return kKernels<kQ6_K>[rows - 1];
  }
}

template <typename Out>
void multiply(const QuantizedRows& x, int64_t M, const uint8_t* w, int64_t type, int64_t N, int64_t row_bytes,
              const float* bias, Out* y) {
  const int64_t groups = (M + kGroup - 1) / kGroup, tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float sums[kGroup];
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t first = tile * kTileRows, last = std::min(N, first + kTileRows);
      for (int64_t g = 0; g < groups; ++g) {  // the tile's rows of W stay in cache for every group of x
        const int64_t row0 = g * kGroup, rows = std::min(kGroup, M - row0);
        const Kernel dot = kernel_for(type, rows);
        for (int64_t n = first; n < last; ++n) {
          dot(w + n * row_bytes, x, row0, sums);
          const float b = bias ? bias[n] : 0.0f;
          for (int64_t r = 0; r < rows; ++r) y[(row0 + r) * N + n] = static_cast<Out>(sums[r] + b);
        }
      }
    }
  });
}

#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
// From this many rows of bf16 x on (a batch of decode tokens, or a prompt), the weight is
// dequantized to bf16 a slice at a time and multiplied by bf16 GEMMs: once enough rows share the
// decoding, faster than the integer kernels, whose every product pays for its block's float scales.
// Below kGemmRows (a batch of decode tokens) the slices are laid out for the native bf16 tiles
// (bf16_tiles.h), from it (a prompt's chunks) they go to oneDNN's GEMM (VDPBF16PS, or AMX tiles where
// they run): at 16 rows oneDNN ran [16, 576] x [576, 3072] at about a third of the tiles' speed.
constexpr int64_t kDequantizedRows = 16;
constexpr int64_t kGemmRows = 32;
constexpr int64_t kItemBlocks = 6;                   // the tiles' column blocks of 16 per work item
constexpr int64_t kTileElements = int64_t(1) << 22;  // oneDNN's slices: 8 MiB of bf16 scratch at most

// 16 registers of 16 int32, rows to columns: r[i][j] becomes r[j][i].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows interleaved: lane L of t[2i] holds rows 2i, 2i + 1 at 4L, 4L + 1
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4g + c], lane L: column 4L + c of rows 4g to 4g + 3
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
  }
}

// The weight's column blocks [first, last) of 16 rows each dequantized into the tiles' layout
// ([block][K/2][16][2]) at `paired`, 16 rows at a time through `scratch` (16 rows of K).
void dequantize_paired(int64_t type, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t first, int64_t last,
                       at::BFloat16* scratch, at::BFloat16* paired) {
  const int64_t pairs = K / 2;  // K: whole blocks, so whole runs of 16 pairs
  const int32_t* rows = reinterpret_cast<const int32_t*>(scratch);
  for (int64_t block = first; block < last; ++block) {
    for (int64_t j = 0; j < 16; ++j) dequantize_row(type, w + (block * 16 + j) * row_bytes, K, scratch + j * K);
    int32_t* out = reinterpret_cast<int32_t*>(paired + (block - first) * pairs * 32);
    for (int64_t p = 0; p < pairs; p += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(rows + j * pairs + p);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out + (p + i) * 16, r[i]);
    }
  }
}

void paired_multiply(const at::BFloat16* x, int64_t M, const uint8_t* w, int64_t type, int64_t K, int64_t N,
                     int64_t row_bytes, const float* bias, at::BFloat16* y) {
  using namespace bf16_tiles;
  const int64_t pairs = K / 2, blocks = N / kBlock, groups = (M + kGroup - 1) / kGroup;
  const std::vector<int32_t> rows = pair_rows(x, M, pairs);
  at::parallel_for(0, (blocks + kItemBlocks - 1) / kItemBlocks, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<at::BFloat16> scratch, paired;  // a work item's slice, in the core's cache
    scratch.resize(kBlock * K);
    paired.resize(kItemBlocks * kBlock * K);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = item * kItemBlocks, last = std::min(blocks, first + kItemBlocks);
      dequantize_paired(type, w, row_bytes, K, first, last, scratch.data(), paired.data());
      multiply_blocks(rows.data(), M, 0, groups, pairs, paired.data(), first, last, bias, y, N);
    }
  });
}

void gemm_multiply(const torch::Tensor& x, const uint8_t* w, int64_t type, int64_t K, int64_t N, int64_t row_bytes,
                   torch::Tensor& y) {
  const int64_t tile_rows = std::min(N, std::max<int64_t>(16, kTileElements / K));
  thread_local torch::Tensor scratch;  // reused, as the integer kernels' QuantizedRows
  if (!scratch.defined() || scratch.numel() < tile_rows * K) scratch = torch::empty({tile_rows * K}, x.options());
  for (int64_t first = 0; first < N; first += tile_rows) {
    const int64_t rows = std::min(tile_rows, N - first);
    at::BFloat16* tile = scratch.data_ptr<at::BFloat16>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) dequantize_row(type, w + (first + n) * row_bytes, K, tile + n * K);
    });
    auto out = y.narrow(1, first, rows);
    at::mm_out(out, x, scratch.narrow(0, 0, rows * K).view({rows, K}).t());
  }
}
#endif

int64_t columns_of(const torch::Tensor& weight, int64_t type) {
  const Layout layout = layout_of(type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) % layout.bytes == 0,
              "quant_linear takes a contiguous uint8 weight [N, blocks * ", layout.bytes, "]");
  return weight.size(1) / layout.bytes * layout.elements;
}

}  // namespace

std::string quant_linear_isa() {
#if defined(QUANT_AVX512) && defined(__AVX512VNNI__)
  return "AVX512-VNNI";
#elif defined(QUANT_AVX512)
  return "AVX512BW";
#elif defined(QUANT_AVX2) && defined(__AVXVNNI__)
  return "AVX-VNNI";
#elif defined(QUANT_AVX2)
  return "AVX2";
#else
  return "scalar";
#endif
}

// The rows of bf16 x from which quant_linear multiplies a dequantized bf16 weight; 0: never (a
// build without AVX512-BF16).
int64_t quant_linear_dequantized_rows() {
#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
  return kDequantizedRows;
#else
  return 0;
#endif
}

// x: [M, K] float32 or bf16; weight: [N, K / block * bytes per block] uint8, ggml blocks of `type`
// (a GGMLQuantizationType); bias: [N] float32 or undefined. Returns x @ W^T + bias, [M, N], x's dtype.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> bias) {
  const int64_t K = columns_of(weight, type), N = weight.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear takes float32 or bf16 rows [M, ", K, "]");
  x = x.contiguous();
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "quant_linear takes a float32 bias of ", N);
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const uint8_t* w = weight.data_ptr<uint8_t>();
#if defined(QUANT_AVX512) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && M >= kDequantizedRows) {
    if (M < kGemmRows && N % bf16_tiles::kBlock == 0) {
      paired_multiply(x.data_ptr<at::BFloat16>(), M, w, type, K, N, weight.size(1), b, y.data_ptr<at::BFloat16>());
      return y;
    }
    gemm_multiply(x, w, type, K, N, weight.size(1), y);
    if (b) y.add_(*bias);
    return y;
  }
#endif
  thread_local QuantizedRows rows;  // reused: a decode step allocates nothing but its output
  if (x.scalar_type() == at::kFloat) {
    quantize_rows(x.data_ptr<float>(), M, K, type, rows);
    multiply(rows, M, w, type, N, weight.size(1), b, y.data_ptr<float>());
  } else {
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, type, rows);
    multiply(rows, M, w, type, N, weight.size(1), b, y.data_ptr<at::BFloat16>());
  }
  return y;
}

// weight as quant_linear takes it; returns its values, float32 [N, K].
torch::Tensor quant_dequantize(torch::Tensor weight, int64_t type) {
  const int64_t K = columns_of(weight, type), N = weight.size(0), row_bytes = weight.size(1);
  auto y = torch::empty({N, K}, torch::kFloat);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) dequantize_row(type, w + n * row_bytes, K, out + n * K);
  });
  return y;
}
