"""Run by another environment's Python (vLLM's, transformers 4's): tokenize a corpus with the
tokenizer of a model directory, as that environment's transformers (or vLLM) loads it.

    python tests/tokenize_corpus.py MODEL_DIR CORPUS.json [--vllm]

Prints {"version": ..., "class": ..., "ids": [[...], ...]} as JSON.
"""

import json
import sys

directory, corpus_path = sys.argv[1], sys.argv[2]
if "--vllm" in sys.argv:
    import vllm
    from vllm.tokenizers import get_tokenizer

    tokenizer, version = get_tokenizer(directory), f"vllm {vllm.__version__}"
else:
    import transformers
    from transformers import AutoTokenizer

    tokenizer, version = AutoTokenizer.from_pretrained(directory), f"transformers {transformers.__version__}"
corpus = json.load(open(corpus_path))
print(json.dumps({"version": version, "class": type(tokenizer).__name__,
                  "ids": [tokenizer.encode(text) for text in corpus]}))
