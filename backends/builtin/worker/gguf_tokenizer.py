"""A GGUF's byte-level BPE tokenizer ("gpt2" models), rebuilt from the file's own metadata the way
llama.cpp reads it, and written as a plain Hugging Face tokenizer (`tokenizer.json`, and a
`tokenizer_config.json` every transformers release and vLLM read alike).

llama.cpp pre-tokenizes with a list of regexes chosen by `tokenizer.ggml.pre`, each splitting
the pieces the previous one left (`src/llama-vocab.cpp`, `llm_tokenizer_bpe`); special tokens
(control and user-defined token types) are matched in text first; a BOS or EOS token is added
only where `tokenizer.ggml.add_bos_token` / `add_eos_token` say so. transformers' own GGUF
conversion differs across its releases on exactly these points (4.57 adds a BOS the file says
not to add), so the engine does not depend on it for these models.
"""

from __future__ import annotations

import json
from pathlib import Path

from backends.builtin.worker.gguf_file import gguf_field

# GPT-2's pattern, as llama.cpp spells it.
GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
LLAMA3 = ("(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?"
          "[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
# `tokenizer.ggml.pre` -> llama.cpp's regexes for it (llama-vocab.cpp, the constructor of
# `llm_tokenizer_bpe`). Pre-tokenizers not listed here are converted by transformers instead.
PRE_TOKENIZERS: dict[str, list[str]] = {
    **{pre: ["\\p{N}", GPT2] for pre in ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                                          "minerva")},
    **{pre: [GPT2] for pre in ("gpt-2", "phi-2", "jina-es", "jina-de", "gpt3-finnish", "mpt", "olmo",
                               "jais")},
    **{pre: [LLAMA3] for pre in ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken")},
}
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken"}  # llama.cpp's `ignore_merges`
CONTROL, USER_DEFINED = 3, 4  # llama_token_type


def buildable(reader) -> bool:
    return (gguf_field(reader, "tokenizer.ggml.model") == "gpt2"
            and gguf_field(reader, "tokenizer.ggml.pre") in PRE_TOKENIZERS)


def write(reader, directory: Path, max_length: int) -> None:
    """`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for the GGUF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges", [])]
    pre = gguf_field(reader, "tokenizer.ggml.pre")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(types) if kind in (CONTROL, USER_DEFINED)])

    def named(key: str) -> str | None:
        index = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special = {f"{key}_token": named(key) for key in ("bos", "eos", "unk")}
    special["pad_token"] = named("padding")
    add_bos, add_eos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)), \
        bool(gguf_field(reader, "tokenizer.ggml.add_eos_token", False))
    single = ["$A"]
    if add_bos and special["bos_token"]:
        single.insert(0, special["bos_token"])
    if add_eos and special["eos_token"]:
        single.append(special["eos_token"])
    pieces = [t for t in single if t != "$A"]
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=" ".join(single), pair=" ".join(single + ["$B"]),
                                      special_tokens=[(t, vocab[t]) for t in pieces]),
    ])
    tokenizer.save(str(directory / "tokenizer.json"))
    present = {k: v for k, v in special.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", **present, "add_bos_token": add_bos, "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
    }
    template = gguf_field(reader, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    (directory / "special_tokens_map.json").write_text(json.dumps(present, indent=2, ensure_ascii=False))
