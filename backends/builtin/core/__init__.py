"""The engine core, in a process of its own: the command loop (`loop`), the step (`engine`:
schedule -> run the model and sample -> the scheduler applies the output), continuous batching
(`scheduler`, the one writer of a sequence's state after a step), the paged KV cache with prefix
caching (`kv_cache`), a sequence's state (`sequence`), sampling (`sampler`), incremental text and
stop strings (`detokenizer`) and grammar masks (`structured`)."""
