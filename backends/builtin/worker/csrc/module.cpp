// The native CPU kernels' Python bindings (built by backends/builtin/worker/kernels.py).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor positions, double scale);
bool chunk_attention_native();
bool chunk_attention_amx();
torch::Tensor chunk_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor scales, torch::Tensor block_tables, torch::Tensor query_starts,
                              torch::Tensor context_lens, double scale, bool amx);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
bool bf16_linear_native();
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
std::string quant_linear_isa();
int64_t quant_linear_dequantized_rows();
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor weight, int64_t type, c10::optional<torch::Tensor> bias);
torch::Tensor quant_dequantize(torch::Tensor weight, int64_t type);
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor a, torch::Tensor b, torch::Tensor slots,
              torch::Tensor widths, torch::Tensor offsets);
std::vector<torch::Tensor> decode_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                                         torch::Tensor block_tables, torch::Tensor positions,
                                         std::vector<torch::Tensor> caches, std::vector<torch::Tensor> layers,
                                         std::vector<int64_t> kinds, int64_t heads, int64_t kv_heads, double eps,
                                         double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Exact attention over a paged KV cache (CPU)");
  m.def("chunk_attention_native", &chunk_attention_native, "Whether chunk_attention was built (AVX-512)");
  m.def("chunk_attention_amx", &chunk_attention_amx, "Whether chunk_attention can take AMX tiles (bf16 caches)");
  m.def("chunk_attention", &chunk_attention, "Causal attention of prompt chunks over a paged KV cache (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rms_norm(residual), in place (float32 or bf16)");
  m.def("rotary", &rotary, "Rotary embedding of qkv's query and key heads, in place (float32 or bf16)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (float32 or bf16)");
  m.def("bf16_linear_native", &bf16_linear_native, "Whether bf16_linear was built with AVX512-BF16");
  m.def("bf16_linear", &bf16_linear, "x @ w^T + b in bf16, w laid out [N/16, K/2, 16, 2] (AVX512-BF16)",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("quant_linear_isa", &quant_linear_isa, "The instructions quant_linear's integer dot products were built for");
  m.def("quant_linear_dequantized_rows", &quant_linear_dequantized_rows,
        "The rows of bf16 x from which quant_linear multiplies a dequantized bf16 weight (0: never)");
  m.def("quant_linear", &quant_linear,
        "x @ W^T + b, W in ggml blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) [N, row bytes], x float32 or bf16",
        py::arg("x"), py::arg("weight"), py::arg("type"), py::arg("bias") = py::none());
  m.def("quant_dequantize", &quant_dequantize, "The float32 values [N, K] of a weight in ggml blocks",
        py::arg("weight"), py::arg("type"));
  m.def("decode_layers", &decode_layers,
        "A decode step's Llama-shaped decoder layers on native projections, in one call (CPU)");
  m.def("lora_add", &lora_add, "y += LoRA(x), each token on its adapter's slot (float32 or bf16 x and y)");
}
