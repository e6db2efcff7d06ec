"""The model worker, inside the core process: a scheduled batch's forward pass (`model_runner`),
attention over the paged KV cache (`attention`), the native CPU kernels (`kernels`, built from
`csrc/` for what this CPU can run), the architectures (`models/`) and model files read into a
config, weights and a tokenizer (`loader`, `gguf_file`, `gguf_tokenizer`)."""
