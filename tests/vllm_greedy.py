"""Run in vLLM's own environment (`backends.peers`): vLLM's offline engine on each model directory
given, in float32, greedy; one JSON line per model on stdout (its tokens for every prompt, or the
error that stopped it). One process for all: vLLM's import is the larger part of its start."""

import json
import sys

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

prompts, max_tokens, max_model_len = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for directory in sys.argv[4:]:
    try:
        llm = LLM(model=directory, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        result = {"tokens": [list(out.outputs[0].token_ids) for out in outputs]}
        del llm
    except Exception as exc:  # reported per model: the others still run
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print("RESULT " + json.dumps({"model": directory, **result}), flush=True)
