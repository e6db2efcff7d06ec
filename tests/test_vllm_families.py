"""Each family the engine serves, against vLLM's CPU build, which serves them all: the same tiny
random-weight models (tests/families.py), float32, greedy, token for token. Skips, saying why,
where vLLM's environment is not provisioned (`python -m backends.peers vllm`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.builtin.worker.loader import load_model
from tests.conftest import provisioned_or_skip
from tests.families import build, family_configs
from tests.test_architectures import GREEDY, NEW_TOKENS, prompts

pytestmark = pytest.mark.slow
# Beyond Phi's original context (64): vLLM, as the engine and llama.cpp, then takes longrope's long factors.
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def vllm_tokens(tmp_path_factory, default_model_dir) -> dict[str, tuple[Path, dict]]:
    from backends import peers

    python = provisioned_or_skip(peers.vllm_python)
    directories = {}
    for model_type in sorted(family_configs()):
        directories[model_type] = tmp_path_factory.mktemp(model_type)
        build(model_type, directories[model_type], default_model_dir)
    command = [str(python), str(Path(__file__).with_name("vllm_greedy.py")), json.dumps(prompts()), str(NEW_TOKENS),
               str(MAX_MODEL_LEN), *map(str, directories.values())]
    done = subprocess.run(command, env={**peers.vllm_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                          capture_output=True, text=True, timeout=1500)
    results = {json.loads(line[7:])["model"]: json.loads(line[7:]) for line in done.stdout.splitlines()
               if line.startswith("RESULT ")}
    if len(results) != len(directories):
        sys.stderr.write(done.stderr[-5000:])
    return {model_type: (directory, results.get(str(directory), {"error": "no result: vLLM stopped"}))
            for model_type, directory in directories.items()}


@pytest.mark.parametrize("model_type", sorted(family_configs()))
def test_greedy_tokens_equal_vllms(model_type, vllm_tokens, make_engine):
    directory, result = vllm_tokens[model_type]
    assert "error" not in result, result["error"]
    engine = make_engine(load_model(directory), max_model_len=MAX_MODEL_LEN)
    assert [out[0] for out in engine.generate(prompts(), GREEDY)] == result["tokens"]
