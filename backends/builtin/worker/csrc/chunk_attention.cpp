// Causal attention of prompt chunks, read straight from the paged KV cache, for CPUs.
//
// A chunk is a run of consecutive tokens of one sequence (a whole prompt, or the part of it
// after cached tokens); its token r at absolute position p sees keys 0..p. One work item is 16
// tokens of one chunk and one KV head, with the query heads that share it (GQA): its keys and
// values are laid out once for all its rows (in float32, or, for a bf16 cache on a CPU
// with AVX512-BF16, kept in bf16 pairs for VDPBF16PS), read through the block table, so nothing
// is gathered or padded; its rows then walk them four at a time, an exact softmax in float32 over
// the keys each row sees; where AMX runs (and the caller asks), sixteen rows a tile product
// instead, in items of 128 tokens. Where SDPA over a padded gather attends every key under a mask,
// this does the causal half, and the largest items go first so the threads finish together. AVX-512
// only: with AVX2's sixteen 8-lane registers a row's accumulators do not stay in registers, and
// SDPA's GEMMs over the gathered context were 1.5-2x faster than a portable form of this loop
// (AMD EPYC Zen 3), so there the engine takes SDPA.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_exp.h"

bool chunk_attention_native() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
constexpr int64_t kTile = 16;         // query tokens of one item, and half the key slots of one step
constexpr int64_t kRows = 4;          // query rows walked together, their accumulators in registers
constexpr int64_t kStep = 2 * kTile;  // keys a step

struct Item {
  int64_t seq, kv_head, first, last;  // tokens first..last-1 of the chunk
  int64_t cost;                       // key tiles its rows visit
};

// The chunk an item belongs to: its block table, and where its rows lie among the query's.
struct Chunk {
  const int64_t* table;
  int64_t start, first_position, heads, kv_heads, block_size;
  int64_t slot(int64_t j) const { return table[j / block_size] * block_size + j % block_size; }
  int64_t group() const { return heads / kv_heads; }  // query heads per KV head
  int64_t rows(const Item& item) const { return (item.last - item.first) * group(); }
  int64_t keys(const Item& item) const { return first_position + item.last; }  // what its last token sees
  // The query (and output) row of the item's row-th row: token row / group, query head row % group.
  int64_t row_of(const Item& item, int64_t row) const {
    return (start + item.first + row / group()) * heads + item.kv_head * group() + row % group();
  }
};

// Sixteen rows of sixteen 32-bit values transposed in registers: pairs of rows interleaved, then
// pairs of pairs, then 128-bit lanes gathered twice.
static inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: rows i..i+3 of columns c, c + 4, c + 8, c + 12, one per lane
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // t[c]: columns c and c + 8; t[c + 4]: c + 4 and c + 12 (rows 0-7, or 8-15 at + 8)
    t[c] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
    t[c + 4] = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    t[c + 8] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    t[c + 12] = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
  }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
}

// The key and value rows of a tile's sixteen slots from j0 on, for the item's KV head; null past
// the chunk's last key (read as 0: 0 * garbage could be NaN).
template <typename scalar_t, int64_t D>
static void tile_rows(const Chunk& chunk, const Item& item, int64_t j0, const scalar_t* key_cache,
                      const scalar_t* value_cache, const scalar_t* (&k)[kTile], const scalar_t* (&v)[kTile]) {
  for (int64_t i = 0; i < kTile; ++i) {
    const int64_t offset =
        j0 + i < chunk.keys(item) ? (chunk.slot(j0 + i) * chunk.kv_heads + item.kv_head) * D : -1;
    k[i] = offset < 0 ? nullptr : key_cache + offset;
    v[i] = offset < 0 ? nullptr : value_cache + offset;
  }
}

// 64 bytes of a row from element `at` on; zeros for a null row.
template <typename scalar_t>
static inline __m512i row512(const scalar_t* from, int64_t at) {
  return from ? _mm512_loadu_si512(from + at) : _mm512_setzero_si512();
}

// An item's keys and values in float32 once (a float32 cache's copied, sixteen slots' keys
// transposed in registers; others widened), keys transposed sixteen slots to a vector
// ([tile][d][slot]), values row by row; each key or value vector feeds four rows' FMAs.
template <typename scalar_t, int64_t D>
struct FloatTiles {
  std::vector<float> keys, values, q;

  void load(const Chunk& chunk, const Item& item, const void* query_, const scalar_t* key_cache,
            const scalar_t* value_cache, const float* k_scales, const float* v_scales, float scale) {
    const auto* query = static_cast<const float*>(query_);
    const int64_t keys_len = chunk.keys(item), rows = chunk.rows(item);
    const int64_t padded = (keys_len + kStep - 1) / kStep * kStep;
    keys.resize(padded * D);
    values.resize(padded * D);
    if constexpr (std::is_same_v<scalar_t, float>) {  // nothing to widen or scale: sixteen slots transposed at once
      for (int64_t j0 = 0; j0 < padded; j0 += kTile) {
        const float *k[kTile], *v[kTile];
        tile_rows<float, D>(chunk, item, j0, key_cache, value_cache, k, v);
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          __m512i block[16];
          for (int64_t i = 0; i < kTile; ++i) block[i] = row512(k[i], d0);
          transpose16(block);
          for (int64_t d = 0; d < 16; ++d) _mm512_storeu_si512(keys.data() + (j0 * D + (d0 + d) * kTile), block[d]);
        }
        for (int64_t i = 0; i < kTile; ++i)
          for (int64_t d = 0; d < D; d += 16) _mm512_storeu_si512(values.data() + (j0 + i) * D + d, row512(v[i], d));
      }
    } else {  // widened (and scaled, for int8) one element at a time
      const int64_t g = item.kv_head, stride = chunk.kv_heads * D;
      for (int64_t j = 0; j < padded; ++j) {
        float* kt = keys.data() + (j / kTile) * D * kTile + j % kTile;
        float* vr = values.data() + j * D;
        if (j >= keys_len) {  // past the end: weight 0, and 0 * garbage could be NaN
          for (int64_t d = 0; d < D; ++d) kt[d * kTile] = vr[d] = 0.f;
          continue;
        }
        const int64_t slot = chunk.slot(j);
        const scalar_t* k = key_cache + slot * stride + g * D;
        const scalar_t* v = value_cache + slot * stride + g * D;
        const float ks = k_scales ? k_scales[slot * chunk.kv_heads + g] : 1.f;
        const float vs = v_scales ? v_scales[slot * chunk.kv_heads + g] : 1.f;
        for (int64_t d = 0; d < D; ++d) kt[d * kTile] = static_cast<float>(k[d]) * ks;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) vr[d] = static_cast<float>(v[d]) * vs;
      }
    }
    q.assign((rows + kRows - 1) / kRows * kRows * D, 0.f);
    for (int64_t row = 0; row < rows; ++row) {
      const float* from = query + chunk.row_of(item, row) * D;
      for (int64_t d = 0; d < D; ++d) q[row * D + d] = from[d] * scale;
    }
  }

  // Rows row0.. scored against the step's 32 keys, scaled.
  void scores(int64_t row0, int64_t step, __m512 (&s)[kRows][2]) const {
    const float* kt = keys.data() + step * kStep * D;
    const float* qr = q.data() + row0 * D;
    for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (D + d) * kTile);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 x = _mm512_set1_ps(qr[r * D + d]);
        s[r][0] = _mm512_fmadd_ps(x, k0, s[r][0]);
        s[r][1] = _mm512_fmadd_ps(x, k1, s[r][1]);
      }
    }
  }

  // o += the step's values, weighted by each row's 32 weights p.
  void add_values(int64_t step, const __m512 (&p)[kRows][2], __m512 (&o)[kRows][D / 16]) const {
    alignas(64) float w[kRows][kStep];
    for (int64_t r = 0; r < kRows; ++r) {
      _mm512_store_ps(w[r], p[r][0]);
      _mm512_store_ps(w[r] + kTile, p[r][1]);
    }
    const float* vt = values.data() + step * kStep * D;
    for (int64_t i = 0; i < kStep; ++i) {
      __m512 v[D / 16];
      for (int64_t c = 0; c < D / 16; ++c) v[c] = _mm512_loadu_ps(vt + i * D + 16 * c);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512 x = _mm512_set1_ps(w[r][i]);
        for (int64_t c = 0; c < D / 16; ++c) o[r][c] = _mm512_fmadd_ps(x, v[c], o[r][c]);
      }
    }
  }
};

#if defined(__AVX512BF16__)
// Word indices that interleave two vectors of 32 bf16 values: the first 16 of each, then the last 16.
static const __m512i kInterleaveLow = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
static const __m512i kInterleaveHigh = _mm512_add_epi16(kInterleaveLow, _mm512_set1_epi16(16));

// A bf16 cache on a CPU with AVX512-BF16: the same walk in dot products of bf16 pairs (VDPBF16PS:
// exact products, float32 sums, 32 multiply-adds an instruction where an FMA does 16). Nothing is
// widened: keys are laid out with a pair of dimensions for sixteen slots in a register
// ([tile][d/2][slot][2]), values with a pair of keys for sixteen dimensions ([key/2][d][2]); the
// query is a bf16 model's, so it converts exactly, and the weights are rounded to bf16 for the
// values' product, as PyTorch's flash attention rounds them for a bf16 model.
template <int64_t D>
struct Bf16Pairs {
  static constexpr int64_t kPairs = D / 2;
  std::vector<uint32_t> keys, values, q;  // each element a pair of bf16 values
  float scale = 1.f;

  void load(const Chunk& chunk, const Item& item, const void* query, const at::BFloat16* key_cache,
            const at::BFloat16* value_cache, const float*, const float*, float scale_) {
    load_keys_values(chunk, item, key_cache, value_cache);
    load_query(chunk, item, static_cast<const float*>(query), kRows);
    scale = scale_;
  }

  void load_keys_values(const Chunk& chunk, const Item& item, const at::BFloat16* key_cache,
                        const at::BFloat16* value_cache) {
    const int64_t keys_len = chunk.keys(item);
    const int64_t padded = (keys_len + kStep - 1) / kStep * kStep;
    keys.resize(padded * kPairs);
    values.resize(padded * kPairs);
    for (int64_t j0 = 0; j0 < padded; j0 += kTile) {
      const at::BFloat16 *k[kTile], *v[kTile];
      tile_rows<at::BFloat16, D>(chunk, item, j0, key_cache, value_cache, k, v);
      for (int64_t p0 = 0; p0 < kPairs; p0 += 16) {  // keys: 16 slots x 16 pairs, transposed
        __m512i block[16];
        for (int64_t i = 0; i < kTile; ++i) block[i] = row512(k[i], 2 * p0);
        transpose16(block);
        for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(keys.data() + (j0 * kPairs + (p0 + p) * kTile), block[p]);
      }
      for (int64_t i = 0; i < kTile; i += 2) {  // values: two keys' rows interleaved, 32 dimensions at a time
        uint32_t* pair = values.data() + (j0 + i) / 2 * D;
        for (int64_t d = 0; d < D; d += 32) {
          const __m512i first = row512(v[i], d), second = row512(v[i + 1], d);
          _mm512_storeu_si512(pair + d, _mm512_permutex2var_epi16(first, kInterleaveLow, second));
          _mm512_storeu_si512(pair + d + 16, _mm512_permutex2var_epi16(first, kInterleaveHigh, second));
        }
      }
    }
  }

  // The item's query rows as bf16 pairs, zero rows padding them to a multiple of `multiple`: a
  // float32 query converted (exactly: a bf16 model's), a bf16 one copied.
  template <typename query_t>
  void load_query(const Chunk& chunk, const Item& item, const query_t* query, int64_t multiple) {
    const int64_t rows = chunk.rows(item);
    q.assign((rows + multiple - 1) / multiple * multiple * kPairs, 0);
    for (int64_t row = 0; row < rows; ++row) {
      const query_t* from = query + chunk.row_of(item, row) * D;
      if constexpr (std::is_same_v<query_t, float>) {
        for (int64_t p = 0; p < D / 32; ++p)
          _mm512_storeu_si512(q.data() + row * kPairs + 16 * p,
                              (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(from + 32 * p + 16),
                                                           _mm512_loadu_ps(from + 32 * p)));
      } else {
        std::memcpy(q.data() + row * kPairs, from, D * sizeof(query_t));
      }
    }
  }

  void scores(int64_t row0, int64_t step, __m512 (&s)[kRows][2]) const {
    const uint32_t* kt = keys.data() + step * kStep * kPairs;
    const uint32_t* qr = q.data() + row0 * kPairs;
    for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < kPairs; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kTile);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (kPairs + p) * kTile);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(qr[r * kPairs + p]);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, x);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, x);
      }
    }
    for (int64_t r = 0; r < kRows; ++r)
      for (auto& half : s[r]) half = _mm512_mul_ps(half, _mm512_set1_ps(scale));
  }

  void add_values(int64_t step, const __m512 (&p)[kRows][2], __m512 (&o)[kRows][D / 16]) const {
    alignas(64) uint32_t w[kRows][kTile];  // each row's weights in bf16, pairs of consecutive keys
    for (int64_t r = 0; r < kRows; ++r) _mm512_store_si512(w[r], (__m512i)_mm512_cvtne2ps_pbh(p[r][1], p[r][0]));
    const uint32_t* vt = values.data() + step * kTile * D;
    for (int64_t i = 0; i < kTile; ++i) {
      __m512bh v[D / 16];
      for (int64_t c = 0; c < D / 16; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + i * D + 16 * c);
      for (int64_t r = 0; r < kRows; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(w[r][i]);
        for (int64_t c = 0; c < D / 16; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], v[c], x);
      }
    }
  }
};
#endif

// One item, four rows at a time, in three passes over the item's keys: the rows' scores (kept,
// with each row's running maximum over the keys it sees), their exponentials and sums, then the
// weighted values, 32 keys a step with the four rows' sums in registers. Their scores take 16 bytes
// a key (in L1 or L2 up to tens of thousands of keys), and no step rescales the sums as an online
// softmax would.
// `Tiles` lays out the keys and values once for all the item's rows.
template <typename Tiles, typename scalar_t, int64_t D>
static void attend_item(const Item& item, const Chunk& chunk, const void* query, const scalar_t* key_cache,
                        const scalar_t* value_cache, const float* k_scales, const float* v_scales, float scale,
                        void* out_) {
  auto* out = static_cast<float*>(out_);
  thread_local Tiles tiles;
  thread_local std::vector<float> weights;  // [kRows][keys the group's last row sees, rounded up to a step]
  const int64_t group = chunk.group(), rows = chunk.rows(item);
  tiles.load(chunk, item, query, key_cache, value_cache, k_scales, v_scales, scale);
  for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
    int64_t visible[kRows];  // keys 0..position: a padding row repeats the last row's; its output is dropped
    for (int64_t r = 0; r < kRows; ++r)
      visible[r] = chunk.first_position + item.first + std::min(row0 + r, rows - 1) / group + 1;
    const int64_t steps = (visible[kRows - 1] + kStep - 1) / kStep, width = steps * kStep;  // the last row sees the most
    weights.resize(kRows * width);
    __m512 top[kRows];
    for (auto& t : top) t = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t step = 0; step < steps; ++step) {
      __m512 s[kRows][2];
      tiles.scores(row0, step, s);
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t half = 0; half < 2; ++half) {
          const int64_t seen = std::clamp<int64_t>(visible[r] - step * kStep - half * kTile, 0, kTile);
          top[r] = _mm512_mask_max_ps(top[r], static_cast<__mmask16>((1u << seen) - 1), top[r], s[r][half]);
          _mm512_storeu_ps(weights.data() + r * width + step * kStep + half * kTile, s[r][half]);
        }
      }
    }
    __m512 sum[kRows];
    for (int64_t r = 0; r < kRows; ++r) {  // scores -> exponentials, 0 past the row's last key
      const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(top[r]));
      sum[r] = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; j += kTile) {
        float* w = weights.data() + r * width + j;
        const int64_t seen = std::clamp<int64_t>(visible[r] - j, 0, kTile);
        const __m512 e = seen == 0 ? _mm512_setzero_ps()
                                   : _mm512_maskz_mov_ps(static_cast<__mmask16>((1u << seen) - 1),
                                                         exp512_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(w), max)));
        sum[r] = _mm512_add_ps(sum[r], e);
        _mm512_storeu_ps(w, e);
      }
    }
    __m512 o[kRows][D / 16];
    for (auto& row : o)
      for (auto& acc : row) acc = _mm512_setzero_ps();
    for (int64_t step = 0; step < steps; ++step) {
      __m512 p[kRows][2];
      for (int64_t r = 0; r < kRows; ++r)
        for (int64_t half = 0; half < 2; ++half)
          p[r][half] = _mm512_loadu_ps(weights.data() + r * width + step * kStep + half * kTile);
      tiles.add_values(step, p, o);
    }
    for (int64_t r = 0; r < kRows && row0 + r < rows; ++r) {
      float* dst = out + chunk.row_of(item, row0 + r) * D;
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum[r]));
      for (int64_t c = 0; c < D / 16; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[r][c], inv));
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the AMX tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); oneDNN asks too, but this kernel may run first.
static bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Every tile 16 rows of 64 bytes: a query or weight tile (16 rows x 32 bf16), a key or value tile
// (16 pairs x 16 columns of bf16 pairs), an accumulator (16 x 16 float32).
struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
  }
};

// An item on AMX tiles (a bf16 cache on a CPU whose tile state this process may use), sixteen of
// its rows a tile: their scores, 16 keys a tile product (tmm0 += query tiles tmm4.. x key tiles),
// kept in float32; an exact softmax of each row over the keys it sees, the weights rounded to bf16
// (as in the VDPBF16PS walk); then the weighted values, 32 keys a product into four accumulators
// of 16 dimensions each (tmm0-3). The layouts are Bf16Pairs': a key tile is a 16-key slice of its
// transposed pairs, a value tile 16 key pairs of 16 dimensions.
template <int64_t D>
static void attend_item_amx(const Item& item, const Chunk& chunk, const void* query, const at::BFloat16* key_cache,
                            const at::BFloat16* value_cache, const float*, const float*, float scale, void* out_) {
  auto* out = static_cast<at::BFloat16*>(out_);
  static_assert(D == 64 || D == 128);
  constexpr int64_t kPairs = D / 2;
  thread_local Bf16Pairs<D> tiles;
  thread_local std::vector<float> scores;          // [16][width]
  thread_local std::vector<at::BFloat16> weights;  // [16][width]
  alignas(64) float acc[kTile][64];
  static const TileConfig config;
  _tile_loadconfig(&config);
  const int64_t group = chunk.group(), rows = chunk.rows(item);
  tiles.load_keys_values(chunk, item, key_cache, value_cache);
  tiles.load_query(chunk, item, static_cast<const at::BFloat16*>(query), kTile);  // whole tiles of rows
  const uint32_t* keys = tiles.keys.data();
  const uint32_t* values = tiles.values.data();
  for (int64_t row0 = 0; row0 < rows; row0 += kTile) {
    int64_t visible[kTile];  // keys 0..position: a padding row repeats the last row's; its output is dropped
    for (int64_t r = 0; r < kTile; ++r)
      visible[r] = chunk.first_position + item.first + std::min(row0 + r, rows - 1) / group + 1;
    const int64_t key_tiles = (visible[kTile - 1] + kTile - 1) / kTile;  // the last row sees the most
    const int64_t width = (visible[kTile - 1] + kStep - 1) / kStep * kStep;
    scores.resize(kTile * width);
    weights.resize(kTile * width);
    const uint32_t* q = tiles.q.data() + row0 * kPairs;
    _tile_loadd(4, q, kPairs * 4);
    _tile_loadd(5, q + 16, kPairs * 4);
    if constexpr (D == 128) {
      _tile_loadd(6, q + 32, kPairs * 4);
      _tile_loadd(7, q + 48, kPairs * 4);
    }
    for (int64_t t = 0; t < key_tiles; ++t) {
      const uint32_t* k = keys + t * kTile * kPairs;
      _tile_zero(0);
      _tile_loadd(1, k, 64);
      _tile_dpbf16ps(0, 4, 1);
      _tile_loadd(2, k + 16 * kTile, 64);
      _tile_dpbf16ps(0, 5, 2);
      if constexpr (D == 128) {
        _tile_loadd(1, k + 32 * kTile, 64);
        _tile_dpbf16ps(0, 6, 1);
        _tile_loadd(2, k + 48 * kTile, 64);
        _tile_dpbf16ps(0, 7, 2);
      }
      _tile_stored(0, scores.data() + t * kTile, width * 4);
    }
    float inverse[kTile];
    const float log2_scale = scale * 1.44269504088896341f;  // exp(scale * x) = 2^(log2_scale * x)
    const __m512 scaled = _mm512_set1_ps(log2_scale);
    for (int64_t r = 0; r < kTile; ++r) {  // scores -> weights in bf16, 0 past the row's last key
      const float* s = scores.data() + r * width;
      at::BFloat16* w = weights.data() + r * width;
      const int64_t whole = visible[r] / kTile * kTile;
      const auto tail = static_cast<__mmask16>((1u << (visible[r] - whole)) - 1);
      __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < whole; j += kTile) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
      top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, s + whole));
      const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * log2_scale);
      __m512 sum = _mm512_setzero_ps();
      auto weigh = [&](int64_t j, __mmask16 seen) {  // exp(scale * (score - max))
        const __m512 e = _mm512_maskz_mov_ps(seen, exp2_512_nonpositive(_mm512_fmsub_ps(
                                                       _mm512_loadu_ps(s + j), scaled, shift)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), (__m256i)_mm512_cvtneps_pbh(e));
      };
      for (int64_t j = 0; j < whole; j += kTile) weigh(j, 0xffff);
      int64_t j = whole;
      if (tail) weigh(j, tail), j += kTile;
      for (; j < width; j += kTile) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), _mm256_setzero_si256());
      inverse[r] = 1.f / _mm512_reduce_add_ps(sum);
    }
    for (int64_t half = 0; half < D / 64; ++half) {  // 64 dimensions at a time: four accumulators
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t j = 0; j < width; j += kStep) {
        const uint32_t* v = values + j / 2 * D + half * 64;
        _tile_loadd(4, weights.data() + j, width * 2);
        _tile_loadd(5, v, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 32, D * 4);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, v + 48, D * 4);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, acc[0], 64 * 4);
      _tile_stored(1, acc[0] + 16, 64 * 4);
      _tile_stored(2, acc[0] + 32, 64 * 4);
      _tile_stored(3, acc[0] + 48, 64 * 4);
      for (int64_t r = 0; r < kTile && row0 + r < rows; ++r) {
        at::BFloat16* dst = out + chunk.row_of(item, row0 + r) * D + half * 64;
        const __m512 inv = _mm512_set1_ps(inverse[r]);
        for (int64_t c = 0; c < 4; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inv)));
      }
    }
  }
  _tile_release();
}
#define SERVEGATE_AMX 1
#endif

bool chunk_attention_amx() {
#if defined(SERVEGATE_AMX)
  return true;
#else
  return false;
#endif
}

// The item attention for this cache type and head size: AMX tiles where asked for (and built),
// else bf16 pairs where the CPU multiplies them, else float32 FMAs.
template <typename scalar_t, int64_t D>
static auto item_kernel(bool amx) {
  using Kernel = void (*)(const Item&, const Chunk&, const void*, const scalar_t*, const scalar_t*, const float*,
                          const float*, float, void*);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
#if defined(SERVEGATE_AMX)
    if (amx) return Kernel{attend_item_amx<D>};
#endif
    return Kernel{attend_item<Bf16Pairs<D>, scalar_t, D>};
  } else
#endif
    return Kernel{attend_item<FloatTiles<scalar_t, D>, scalar_t, D>};
}
#else
bool chunk_attention_amx() { return false; }
#endif

// query [T, H, D] float32 (bf16 on AMX, and so the output): the chunks' tokens, one chunk after
// another; caches [N, block_size, Hkv, D] (their K/V already written); scales [2, N, block_size,
// Hkv] float32 for int8 caches, else empty; block_tables [S, max_blocks] int64; query_starts
// [S + 1] int64 (chunk s is query rows query_starts[s]..query_starts[s + 1]); context_lens [S]
// int64 (the chunk's last token is at context_len - 1).
torch::Tensor chunk_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor query_starts,
                              torch::Tensor context_lens, double scale, bool amx) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "the chunk attention kernel is built for AVX-512 only (chunk_attention_native())");
#else
  TORCH_CHECK(query.is_contiguous() && query.dtype() == (amx ? torch::kBFloat16 : torch::kFloat32),
              "query must be contiguous, float32 (bf16 on AMX)");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && query_starts.dtype() == torch::kInt64 &&
                  context_lens.dtype() == torch::kInt64, "indices must be int64");
  const int64_t heads = query.size(1), head_dim = query.size(2), seqs = context_lens.size(0);
  const int64_t block_size = key_cache.size(1), kv_heads = key_cache.size(2), max_blocks = block_tables.size(1);
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128, got ", head_dim);
  TORCH_CHECK(query_starts.size(0) == seqs + 1 && block_tables.size(0) == seqs, "one table and start per chunk");
  const bool int8 = key_cache.scalar_type() == at::kChar;
  TORCH_CHECK(!int8 || (scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.dim() == 4),
              "an int8 cache needs float32 scales [2, N, block_size, Hkv]");
  const float* k_scales = int8 ? scales.data_ptr<float>() : nullptr;
  const float* v_scales = int8 ? k_scales + scales[0].numel() : nullptr;
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* ctx = context_lens.data_ptr<int64_t>();
  TORCH_CHECK(!amx || (chunk_attention_amx() && key_cache.scalar_type() == at::kBFloat16),
              "AMX serves a bf16 cache, where it is built (chunk_attention_amx())");
#if defined(SERVEGATE_AMX)
  TORCH_CHECK(!amx || amx_permitted(), "Linux refused this process the AMX tile state");
#endif
  // On AMX an item takes 128 tokens: its keys and values are laid out once for 8x the rows (the
  // tiles multiply fast enough for that layout to show: 10% of the kernel at 32-token chunks).
  const int64_t item_tokens = amx ? 8 * kTile : kTile;
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    for (int64_t first = 0; first < len; first += item_tokens) {
      const int64_t last = std::min(len, first + item_tokens);
      const int64_t cost = (ctx[s] - len + last + kTile - 1) / kTile;
      for (int64_t g = 0; g < kv_heads; ++g) items.push_back({s, g, first, last, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  auto out = torch::empty_like(query);
  const void* q = query.data_ptr();
  void* o = out.data_ptr();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  auto run = [&](auto* kc, auto* vc) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    auto one = head_dim == 64 ? item_kernel<scalar_t, 64>(amx) : item_kernel<scalar_t, 128>(amx);
    std::atomic<int64_t> next{0};  // each thread takes the next largest item left
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
        const Item& item = items[i];
        const int64_t len = starts[item.seq + 1] - starts[item.seq];
        const Chunk chunk{tables + item.seq * max_blocks, starts[item.seq], ctx[item.seq] - len, heads, kv_heads,
                          block_size};
        one(item, chunk, q, kc, vc, k_scales, v_scales, static_cast<float>(scale), o);
      }
    });
  };
  if (int8) {
    run(key_cache.data_ptr<int8_t>(), value_cache.data_ptr<int8_t>());
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key_cache.scalar_type(), "chunk_attention", [&] {
      run(key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>());
    });
  }
  return out;
#endif
}
