"""servegate's built-in engine: paged KV cache, prefix caching, continuous batching, in PyTorch.
The engine (and PyTorch) load on first use, so reading `EngineConfig` stays cheap."""

from .config import EngineConfig

__all__ = ["BuiltinBackend", "EngineConfig"]


def __getattr__(name: str):
    if name == "BuiltinBackend":
        from .backend import BuiltinBackend

        return BuiltinBackend
    raise AttributeError(name)
