"""servegate's built-in engine: paged KV cache, prefix caching, continuous batching, in PyTorch.
The engine (and PyTorch) load on first use, so reading `EngineConfig` stays cheap.

Its modules by the process they run in (vLLM v1's split; with `engine_process` off, the core
runs on a thread of the API process instead, the same loop):

API process (HTTP's): requests in, streamed outputs out
  backend     the `Backend` adapter: validation, chat templates, tokenization, events
  front       each request's asyncio stream; starts the core (process or thread), sends it commands
  tools       tool calls rendered into prompts and parsed back out of the text
  logprobs    token logprobs in OpenAI's two shapes
Both sides of the boundary
  protocol    the typed commands and messages between the two processes
  config      `EngineConfig`
Core process: the engine core
  core        the command loop (`serve`) and the process's entry (`run`)
  engine      `LLMEngine.step`: schedule -> run the model and sample -> the scheduler applies it
  scheduler   continuous batching; the one writer of a sequence's state after a step
  kv_cache    block pool, block tables and prefix caching
  sequence    a sequence's state
  sampler     next tokens from logits
  detokenizer incremental text and stop strings
  structured  grammar masks (its `check` validates constraints in the API process too)
Model worker (in the core process): the model's forward pass
  model_runner  a scheduled batch -> inputs, KV cache tensors, logits
  attention     attention over the paged KV cache
  kernels       the native CPU kernels (csrc/)
  models/       the model architectures
  loader        model files -> config, weights, tokenizer (the API process loads the tokenizer
                with it too); gguf_file and gguf_tokenizer read GGUF metadata and tokenizers
"""

from .config import EngineConfig

__all__ = ["BuiltinBackend", "EngineConfig"]


def __getattr__(name: str):
    if name == "BuiltinBackend":
        from .backend import BuiltinBackend

        return BuiltinBackend
    raise AttributeError(name)
