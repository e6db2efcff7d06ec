"""servegate's built-in engine: paged KV cache, prefix caching, continuous batching, in PyTorch."""

from .backend import BuiltinBackend
from .config import EngineConfig

__all__ = ["BuiltinBackend", "EngineConfig"]
