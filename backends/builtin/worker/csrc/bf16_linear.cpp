// bf16 Linear layers for CPUs with AVX512-BF16 and no AMX (AMD EPYC Zen 4 and 5): y = x @ w^T + b.
//
// At a decode step's few rows a GEMM is as much memory-bound as compute-bound. oneDNN's blocked
// kernels reach about half the VDPBF16PS rate there; this one streams each weight once per step
// near the rate the cores multiply. The weight is laid out once, at load, for the tiles of
// bf16_tiles.h.
#include "bf16_tiles.h"

#if defined(__AVX512BF16__)
namespace {
constexpr int64_t kItemBlocks = 6;  // column blocks per work item: 96 features, so 576 split six ways
constexpr int64_t kItemRows = 256;  // rows per work item at most: a decode step's in one, a prompt's in a few
}  // namespace
#endif

bool bf16_linear_native() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x: [M, K] bf16; weight: [N/16, K/2, 16, 2] bf16 (bf16_tiles.h's layout); bias: [N] or undefined.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "bf16_linear takes contiguous bf16 rows [M, K]");
  TORCH_CHECK(weight.dim() == 4 && weight.size(2) == 16 && weight.size(3) == 2 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kBFloat16 && weight.size(1) * 2 == x.size(1),
              "bf16_linear takes a weight laid out [N/16, K/2, 16, 2] for K = ", x.size(1));
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16, which this build lacks");
#else
  using namespace bf16_tiles;
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
  const std::vector<int32_t> rows = pair_rows(x.data_ptr<at::BFloat16>(), M, pairs);
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
      multiply_blocks(rows.data(), M, g0, std::min(groups, g0 + item_groups), pairs, w + first * pairs * 2 * kBlock,
                      first, last, b, out, N);
    }
  });
  return y;
#endif
}
