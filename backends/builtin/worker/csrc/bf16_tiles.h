// The tiles of the native bf16 GEMM (AVX512-BF16), shared by bf16_linear.cpp (weights laid out once
// at load) and quant_linear.cpp (GGUF blocks dequantized into the same layout a slice at a time).
//
// The weight is laid out as [N/16][K/2][16][2]: per pair of input features, the pairs of 16 output
// features side by side, one register. A tile of R rows and C such column blocks keeps its R x C
// float32 sums in registers and per pair of features loads C registers of weights and broadcasts
// each row's pair (VDPBF16PS: exact products, float32 sums), so each weight is read once for all
// rows of the tile. The rows are copied pair-major first, 8 at a time, so a tile's broadcasts come
// from one pointer. Sums are rounded to bf16 once, to nearest even, as oneDNN rounds them.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace bf16_tiles {

constexpr int64_t kBlock = 16;    // output features per register of sums
constexpr int64_t kGroup = 8;     // rows per tile at most
constexpr int64_t kColumns = 3;   // column blocks per tile at most: 8 x 3 sums + 3 weights in 32 registers

template <int R, int C>
void tile(const int32_t* x, const at::BFloat16* w, int64_t pairs, const float* bias, at::BFloat16* y, int64_t ldy) {
  __m512 acc[R][C];
  for (int c = 0; c < C; ++c) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + c * kBlock) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][c] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + (c * pairs + p) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[p * kGroup + r]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + c * kBlock), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

using Tile = void (*)(const int32_t*, const at::BFloat16*, int64_t, const float*, at::BFloat16*, int64_t);

template <int C, size_t... R>
constexpr std::array<Tile, kGroup> tiles_of(std::index_sequence<R...>) { return {&tile<R + 1, C>...}; }

// kTiles[c - 1][r - 1]: the tile of r rows and c column blocks
constexpr std::array<std::array<Tile, kGroup>, kColumns> kTiles = {
    tiles_of<1>(std::make_index_sequence<kGroup>{}), tiles_of<2>(std::make_index_sequence<kGroup>{}),
    tiles_of<3>(std::make_index_sequence<kGroup>{})};

// x [M, K] bf16 pair-major, 8 rows at a time: [group][pair][8 rows], each pair an int32.
inline std::vector<int32_t> pair_rows(const at::BFloat16* x, int64_t M, int64_t pairs) {
  const int64_t groups = (M + kGroup - 1) / kGroup;
  std::vector<int32_t> rows(groups * pairs * kGroup);
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m = g * kGroup; m < std::min(M, (g + 1) * kGroup); ++m)
        for (int64_t p = 0; p < pairs; ++p) rows[(g * pairs + p) * kGroup + m % kGroup] = xp[m * pairs + p];
  });
  return rows;
}

// Row groups [g0, g1) of y [M, N] over column blocks [first, last): w holds those blocks laid out
// as above (from block `first` on); bias (or null) and y from column 0.
inline void multiply_blocks(const int32_t* rows, int64_t M, int64_t g0, int64_t g1, int64_t pairs,
                            const at::BFloat16* w, int64_t first, int64_t last, const float* bias, at::BFloat16* y,
                            int64_t N) {
  for (int64_t g = g0; g < g1; ++g) {  // every row group over these columns: their weights stay in cache
    const int64_t r = std::min(kGroup, M - g * kGroup);
    for (int64_t block = first; block < last; block += kColumns) {
      const int64_t c = std::min(kColumns, last - block);
      kTiles[c - 1][r - 1](rows + g * pairs * kGroup, w + (block - first) * pairs * 2 * kBlock, pairs,
                           bias ? bias + block * kBlock : nullptr, y + g * kGroup * N + block * kBlock, N);
    }
  }
}

}  // namespace bf16_tiles
#endif
