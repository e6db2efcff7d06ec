// bf16 Linear layers for CPUs with AVX512-BF16 and no AMX (AMD EPYC Zen 4 and 5): y = x @ w^T + b.
//
// At a decode step's few rows a GEMM is as much memory-bound as compute-bound. oneDNN's blocked
// kernels reach about half the VDPBF16PS rate there; this one streams each weight once per step
// near the rate the cores multiply. The weight is laid out once, at load, as [N/16][K/2][16][2]:
// per pair of input features, the pairs of 16 output features side by side, one register. A
// tile of R rows and C such column blocks keeps its R x C float32 sums in registers and per pair
// of features loads C registers of weights and broadcasts each row's pair (VDPBF16PS: exact
// products, float32 sums), so each weight is read once for all rows of the tile. The rows are
// copied pair-major first, 8 at a time, so a tile's broadcasts come from one pointer. Sums are
// rounded to bf16 once, to nearest even, as oneDNN rounds them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlock = 16;      // output features per register of sums
constexpr int64_t kGroup = 8;       // rows per tile at most
constexpr int64_t kColumns = 3;     // column blocks per tile at most: 8 x 3 sums + 3 weights in 32 registers
constexpr int64_t kItemBlocks = 6;  // column blocks per work item: 96 features, so 576 split six ways
constexpr int64_t kItemRows = 256;  // rows per work item at most: a decode step's in one, a prompt's in a few

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

}  // namespace
#endif

bool bf16_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] bf16; weight: [N/16, K/2, 16, 2] bf16 (the layout above); bias: [N] or undefined.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear takes contiguous bf16 rows [M, K]");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(1) * 2 == x.size(1),
              "bf16_linear takes a weight laid out [N/16, K/2, 16, 2] for K = ", x.size(1));
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16, which this build lacks");
#else
  const int64_t M = x.size(0), pairs = weight.size(1), blocks = weight.size(0), N = blocks * kBlock;
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  torch::Tensor bias32;  // float32 sums start from the bias, rounded with them once
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias of ", bias->numel(), " for ", N, " outputs");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int64_t groups = (M + kGroup - 1) / kGroup;
  std::vector<int32_t> rows(groups * pairs * kGroup);  // [group][pair][8 rows]: x's bf16 pairs as int32
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t m = g * kGroup; m < std::min(M, (g + 1) * kGroup); ++m)
        for (int64_t p = 0; p < pairs; ++p) rows[(g * pairs + p) * kGroup + m % kGroup] = xp[m * pairs + p];
  });
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  const int64_t column_items = (blocks + kItemBlocks - 1) / kItemBlocks;
  // row items of equal size (whole groups), so that the threads' shares of the items weigh the same
  const int64_t row_items = (M + kItemRows - 1) / kItemRows;
  const int64_t item_groups = (groups + row_items - 1) / row_items;
  at::parallel_for(0, column_items * row_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first = (item % column_items) * kItemBlocks, last = std::min(blocks, first + kItemBlocks);
      const int64_t g0 = (item / column_items) * item_groups;
      // every row group over this item's columns: its weights come from memory once, then from cache
      for (int64_t g = g0; g < std::min(groups, g0 + item_groups); ++g) {
        const int64_t r = std::min(kGroup, M - g * kGroup);
        for (int64_t block = first; block < last; block += kColumns) {
          const int64_t c = std::min(kColumns, last - block);
          kTiles[c - 1][r - 1](rows.data() + g * pairs * kGroup, w + block * pairs * 2 * kBlock, pairs,
                               b ? b + block * kBlock : nullptr, out + g * kGroup * N + block * kBlock, N);
        }
      }
    }
  });
  return y;
#endif
}
