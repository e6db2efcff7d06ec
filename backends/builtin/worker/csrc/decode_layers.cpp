// A decode step's decoder layers in one call, for models whose every layer has the Llama shape
// (RMSNorm before attention and before the MLP, fused q/k/v with optional biases, rotary over whole
// heads, the native paged attention, a gated SiLU MLP) and whose projections are all native ones
// (GGUF blocks for quant_linear, or bf16 pairs for bf16_linear). The Python path makes a dozen
// calls a layer, each paying for the interpreter, the dispatcher and nn.Module's bookkeeping: at
// decode's few rows on a small model, a third of the step. These are the same kernels in the same
// order on the same tensors, so the outputs are the Python path's bit for bit.
#include <torch/extension.h>

#include <vector>

void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> bias);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor positions, double scale);

namespace {

constexpr int64_t kPaired = -1;     // a projection's kind: bf16_linear's paired weight, else a ggml type id
constexpr int64_t kPerLayer = 10;   // tensors: 2 norms, then each projection's weight and bias

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, int64_t kind, const torch::Tensor& bias) {
  const c10::optional<torch::Tensor> b = bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
  return kind == kPaired ? bf16_linear(x, weight, b) : quant_linear(x, weight, kind, b);
}

}  // namespace

// x: [T, hidden], the embedded tokens (each the last of its sequence); cos, sin: [T, head_dim] in
// x's dtype; slots, block_tables, positions: as the paged attention's decode tokens take them;
// caches: each layer's [2, blocks, block size, kv_heads, head_dim] in x's dtype; layers: per layer
// its input norm's and post-attention norm's weights, then q/k/v, o, gate/up and down as (weight,
// bias or an empty tensor); kinds: per layer those 4 projections' kinds. Returns the last layer's
// output and the residual stream before it, as the Python path leaves them.
std::vector<torch::Tensor> decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                         torch::Tensor block_tables, torch::Tensor positions,
                                         std::vector<torch::Tensor> caches, std::vector<torch::Tensor> layers,
                                         std::vector<int64_t> kinds, int64_t heads, int64_t kv_heads, double eps,
                                         double scale) {
  const int64_t count = static_cast<int64_t>(caches.size()), tokens = x.size(0), head_dim = cos.size(1);
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == count * kPerLayer && static_cast<int64_t>(kinds.size()) == count * 4,
              "decode_layers takes ", kPerLayer, " tensors and 4 kinds per layer");
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const torch::Tensor no_scales = torch::empty({0});
  x = x.contiguous();
  torch::Tensor residual = torch::zeros_like(x);
  for (int64_t l = 0; l < count; ++l) {
    const torch::Tensor* w = layers.data() + l * kPerLayer;
    const int64_t* kind = kinds.data() + l * 4;
    add_rms_norm(x, residual, w[0], eps);
    torch::Tensor qkv = linear(x, w[2], kind[0], w[3]);
    rotary(qkv, cos, sin, heads, kv_heads);
    const torch::Tensor& cache = caches[l];
    const torch::Tensor flat = cache.view({2, -1, kv_heads, head_dim});
    flat[0].index_copy_(0, slots, qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim}));
    flat[1].index_copy_(0, slots, qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim}));
    const torch::Tensor query = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim}).to(torch::kFloat).contiguous();
    const torch::Tensor attended =
        paged_attention(query, cache[0], cache[1], no_scales, block_tables, positions, scale).to(x.scalar_type());
    x = linear(attended.view({tokens, q_size}), w[4], kind[1], w[5]);
    add_rms_norm(x, residual, w[1], eps);
    x = linear(silu_mul(linear(x, w[6], kind[2], w[7])), w[8], kind[3], w[9]);
  }
  return {x, residual};
}
