"""The request fields, beyond those `GenerateRequest` carries, that each runtime's adapter passes on
(`Backend.EXTRA_FIELDS`). A client's field outside its backend's set is refused by name before
anything is sent, so nothing unknown reaches an upstream verbatim.

Each set is what the runtime really parses, read from its source at the release servegate
tests against, minus what would let one tenant take what is not billed or not theirs: queue
priority, LoRA or adapter paths, custom logits code, request ids, KV transfer, a client's own
chat template, extra sampled sequences (`best_of`, beam search), and llama-server's `n_predict`
(it overrides `max_tokens`, the limit quotas reserve).
"""

from __future__ import annotations

from . import constraints

# OpenAI's own request fields (openai-python `chat/completion_create_params.py` and
# `completion_create_params.py`), minus `service_tier` and `web_search_options` (they cost more).
OPENAI = frozenset({
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls", "functions", "function_call", "user", "echo", "suffix", "reasoning_effort",
    "verbosity", "prediction", "metadata", "safety_identifier", "prompt_cache_key", "store",
})

# The structured-output spellings beyond OpenAI's, which an adapter rewrites into its runtime's own
# (`constraints.respelled`).
STRUCTURED = constraints.FIELDS - {"response_format"}

# vLLM 0.32 `entrypoints/openai/{chat_completion,completion}/protocol.py`, minus `prompt_logprobs`,
# which vLLM refuses in the streams its adapter asks for ("not available when `stream=True`").
VLLM = OPENAI | STRUCTURED | {
    "min_p", "min_tokens", "repetition_penalty", "length_penalty", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "bad_words",
    "allowed_token_ids", "return_tokens_as_token_ids", "chat_template_kwargs",
    "add_generation_prompt", "continue_final_message", "documents", "truncate_prompt_tokens", "add_special_tokens",
    "include_reasoning", "thinking_token_budget",
}

# SGLang `srt/entrypoints/openai/protocol.py` (ChatCompletionRequest, CompletionRequest) and the
# native `/generate` sampling params (`srt/sampling/sampling_params.py`).
SGLANG = OPENAI | STRUCTURED | {
    "min_p", "min_tokens", "min_new_tokens", "regex", "ebnf", "json_schema", "repetition_penalty", "stop_regex",
    "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "continue_final_message",
    "separate_reasoning", "stream_reasoning", "chat_template_kwargs",
}

# TGI 3.3.7 (its OpenAPI spec): the chat route's ChatRequest and `/generate`'s GenerateParameters.
TGI = OPENAI | STRUCTURED | {"tool_prompt", "repetition_penalty", "watermark", "top_n_tokens", "typical_p",
                             "truncate", "decoder_input_details"}

# llama.cpp's server (`tools/server/server-schema.cpp`, `server-common.cpp`), build b1-0c1e570.
LLAMA_SERVER = OPENAI | STRUCTURED | {
    "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau",
    "mirostat_eta", "dynatemp_range", "dynatemp_exponent", "top_n_sigma", "min_keep", "json_schema",
    "n_probs", "post_sampling_probs", "samplers", "chat_template_kwargs", "reasoning_format",
    "add_generation_prompt", "continue_final_message",
}

# llama-cpp-python 0.3.36's server (`llama_cpp/server/types.py`).
LLAMA_CPP_SERVER = frozenset({
    "frequency_penalty", "presence_penalty", "logit_bias", "logit_bias_type", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "functions", "function_call", "user", "echo", "suffix", "grammar",
    "min_p", "min_tokens", "mirostat_mode", "mirostat_tau", "mirostat_eta", "repeat_penalty",
})

# Fields clients send that change nothing in how a local engine generates.
HARMLESS = frozenset({"user", "parallel_tool_calls", "metadata", "store", "service_tier"})

# servegate's own engine: the sampling knobs and structured outputs it implements
# (backends/builtin/core/sampler.py, structured.py), in OpenAI's and vLLM's spellings.
BUILTIN = HARMLESS | STRUCTURED | {
    "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs",
    "top_logprobs", "response_format", "tools", "tool_choice", "echo", "chat_template_kwargs",
}
