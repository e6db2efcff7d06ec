// Causal attention of prompt chunks, read straight from the paged KV cache, for CPUs.
//
// A chunk is a run of consecutive tokens of one sequence (a whole prompt, or the part of it
// after cached tokens); its token r at absolute position p sees keys 0..p. One work item is 16
// tokens of one chunk and one KV head, with the query heads that share it (GQA): its rows walk
// the keys sixteen slots at a time through the block table (flash attention's online softmax,
// float32), so each slot is widened once for all its rows and nothing is gathered or padded;
// key tiles above a row's position are skipped. Where SDPA over a padded gather attends every
// key under a mask, this does the causal half, and the largest items go first so the threads
// finish together. AVX-512 only: with AVX2's sixteen 8-lane registers a row's accumulators do
// not stay in registers, and SDPA's GEMMs over the gathered context were 1.5-2x faster than a
// portable form of this loop (AMD EPYC Zen 3), so there the engine takes SDPA.
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
constexpr int64_t kTile = 16;  // query tokens of one item, and half the key slots of one step

struct Item {
  int64_t seq, kv_head, first, last;  // tokens first..last-1 of the chunk
  int64_t cost;                       // key tiles its rows visit
};

// One item, four rows at a time so that their accumulators stay in registers:
// the item's keys and values are widened to float32 once (keys transposed, sixteen slots to a
// vector), then each group of four rows walks them 32 keys a step, every key vector feeding four
// rows, one softmax rescale a step; the sums stay in sixteen lanes until the end.
template <typename scalar_t, int64_t D>
static void attend_tile(const Item& item, const float* query, const scalar_t* key_cache, const scalar_t* value_cache,
                        const float* k_scales, const float* v_scales, const int64_t* table, int64_t chunk_start,
                        int64_t first_position, int64_t heads, int64_t kv_heads, int64_t block_size, float scale,
                        float* out) {
  constexpr int64_t kRows = 4, kVecs = D / 16, kStep = 2 * kTile;
  const int64_t group = heads / kv_heads, slot_stride = kv_heads * D, g = item.kv_head;
  const int64_t rows = (item.last - item.first) * group;
  const int64_t keys_len = first_position + item.last, steps = (keys_len + kStep - 1) / kStep;
  thread_local std::vector<float> keys, values, q;
  keys.resize(steps * kStep * D);  // [tile][d][slot]
  values.resize(steps * kStep * D);  // [key][d]
  for (int64_t j = 0; j < steps * kStep; ++j) {
    float* kt = keys.data() + (j / kTile) * D * kTile + j % kTile;
    float* vr = values.data() + j * D;
    if (j >= keys_len) {  // past the end: weight 0, and 0 * garbage could be NaN
      for (int64_t d = 0; d < D; ++d) kt[d * kTile] = vr[d] = 0.f;
      continue;
    }
    const int64_t slot = table[j / block_size] * block_size + j % block_size;
    const scalar_t* k = key_cache + slot * slot_stride + g * D;
    const scalar_t* v = value_cache + slot * slot_stride + g * D;
    const float ks = k_scales ? k_scales[slot * kv_heads + g] : 1.f;
    const float vs = v_scales ? v_scales[slot * kv_heads + g] : 1.f;
    for (int64_t d = 0; d < D; ++d) kt[d * kTile] = static_cast<float>(k[d]) * ks;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) vr[d] = static_cast<float>(v[d]) * vs;
  }
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  q.assign(padded * D, 0.f);
  for (int64_t row = 0; row < rows; ++row) {
    const float* src = query + ((chunk_start + item.first + row / group) * heads + g * group + row % group) * D;
    for (int64_t d = 0; d < D; ++d) q[row * D + d] = src[d] * scale;
  }
  for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
    int64_t position[kRows];
    for (int64_t r = 0; r < kRows; ++r)  // a padding row repeats the last row's position; its output is dropped
      position[r] = first_position + item.first + std::min(row0 + r, rows - 1) / group;
    const float* qr = q.data() + row0 * D;
    __m512 o[kRows][kVecs], max[kRows], sum[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t c = 0; c < kVecs; ++c) o[r][c] = _mm512_setzero_ps();
      max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      sum[r] = _mm512_setzero_ps();
    }
    const int64_t row_steps = (position[kRows - 1] + kStep) / kStep;  // the last row sees the most
    for (int64_t step = 0; step < row_steps; ++step) {
      const float* kt = keys.data() + step * kStep * D;
      __m512 s[kRows][2];
      for (int64_t r = 0; r < kRows; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (D + d) * kTile);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 x = _mm512_set1_ps(qr[r * D + d]);
          s[r][0] = _mm512_fmadd_ps(x, k0, s[r][0]);
          s[r][1] = _mm512_fmadd_ps(x, k1, s[r][1]);
        }
      }
      alignas(64) float p[kRows][kStep];
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t visible = std::clamp<int64_t>(position[r] + 1 - step * kStep, 0, kStep);
        const __mmask16 m0 = static_cast<__mmask16>((1u << std::min<int64_t>(visible, kTile)) - 1);
        const __mmask16 m1 = static_cast<__mmask16>((1u << std::max<int64_t>(visible - kTile, 0)) - 1);
        const __m512 seen = _mm512_mask_max_ps(_mm512_maskz_mov_ps(m0, s[r][0]), m1, s[r][0], s[r][1]);
        const float step_max = visible > kTile ? _mm512_reduce_max_ps(seen) : _mm512_mask_reduce_max_ps(m0, s[r][0]);
        const __m512 new_max = _mm512_max_ps(max[r], _mm512_set1_ps(step_max));
        const __m512 rescale = exp512_nonpositive(_mm512_sub_ps(max[r], new_max));  // 0 on the first step
        const __m512 e0 = _mm512_maskz_mov_ps(m0, exp512_nonpositive(_mm512_sub_ps(s[r][0], new_max)));
        const __m512 e1 = _mm512_maskz_mov_ps(m1, exp512_nonpositive(_mm512_sub_ps(s[r][1], new_max)));
        max[r] = new_max;
        sum[r] = _mm512_fmadd_ps(sum[r], rescale, _mm512_add_ps(e0, e1));
        for (int64_t c = 0; c < kVecs; ++c) o[r][c] = _mm512_mul_ps(o[r][c], rescale);
        _mm512_store_ps(p[r], e0);
        _mm512_store_ps(p[r] + kTile, e1);
      }
      const float* vt = values.data() + step * kStep * D;
      for (int64_t i = 0; i < kStep; ++i) {
        __m512 v[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) v[c] = _mm512_loadu_ps(vt + i * D + 16 * c);
        for (int64_t r = 0; r < kRows; ++r) {
          const __m512 w = _mm512_set1_ps(p[r][i]);
          for (int64_t c = 0; c < kVecs; ++c) o[r][c] = _mm512_fmadd_ps(w, v[c], o[r][c]);
        }
      }
    }
    for (int64_t r = 0; r < kRows && row0 + r < rows; ++r) {
      const int64_t row = row0 + r;
      float* dst = out + ((chunk_start + item.first + row / group) * heads + g * group + row % group) * D;
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum[r]));
      for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(o[r][c], inv));
    }
  }
}
#endif

// query [T, H, D] float32: the chunks' tokens, one chunk after another; caches [N, block_size, Hkv, D]
// (their K/V already written); scales [2, N, block_size, Hkv] float32 for int8 caches, else empty;
// block_tables [S, max_blocks] int64; query_starts [S + 1] int64 (chunk s is query rows
// query_starts[s]..query_starts[s + 1]); context_lens [S] int64 (the chunk's last token is at
// context_len - 1).
torch::Tensor chunk_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor query_starts,
                              torch::Tensor context_lens, double scale) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "the chunk attention kernel is built for AVX-512 only (chunk_attention_native())");
#else
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.is_contiguous(), "query must be contiguous float32");
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
  std::vector<Item> items;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    for (int64_t first = 0; first < len; first += kTile) {
      const int64_t last = std::min(len, first + kTile);
      const int64_t cost = (ctx[s] - len + last + kTile - 1) / kTile;
      for (int64_t g = 0; g < kv_heads; ++g) items.push_back({s, g, first, last, cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  auto run = [&](auto* kc, auto* vc) {
    using scalar_t = std::remove_const_t<std::remove_pointer_t<decltype(kc)>>;
    auto one = head_dim == 64 ? attend_tile<scalar_t, 64> : attend_tile<scalar_t, 128>;
    std::atomic<int64_t> next{0};  // each thread takes the next largest item left
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
      for (int64_t i; (i = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
        const Item& item = items[i];
        const int64_t len = starts[item.seq + 1] - starts[item.seq];
        one(item, q, kc, vc, k_scales, v_scales, tables + item.seq * max_blocks, starts[item.seq],
            ctx[item.seq] - len, heads, kv_heads, block_size, static_cast<float>(scale), o);
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
