"""servegate's built-in engine: paged KV cache, prefix caching, continuous batching, in PyTorch.
The engine (and PyTorch) load on first use, so reading `EngineConfig` stays cheap.

Its packages by the process they run in (vLLM v1's split; with `engine_process` off, the core
runs on a thread of the API process instead, the same loop):

- this package, in the API process: `backend` (the `Backend` adapter: validation, chat templates,
  tokenization, events), `front` (each request's asyncio stream; starts the core, sends it
  commands), `tools` (tool calls into prompts and out of text), `logprobs`; and what both sides
  share: `protocol` (the typed commands and messages between the processes) and `config`;
- `core/`, the engine core's process: the command loop, the step, the scheduler, the KV cache,
  sampling, detokenization and grammar masks;
- `worker/`, the model worker in the core process: the forward pass, attention, the native
  kernels, the architectures and the model loader (whose tokenizer the API process loads too).
"""

from backends.builtin.config import EngineConfig

__all__ = ["BuiltinBackend", "EngineConfig"]


def __getattr__(name: str):
    if name == "BuiltinBackend":
        from backends.builtin.backend import BuiltinBackend

        return BuiltinBackend
    raise AttributeError(name)
