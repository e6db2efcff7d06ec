"""The engine core's synchronous step (`LLMEngine`), in the core process or on the thread mode's
thread: `step()` = schedule -> run the model and sample -> the scheduler applies the output.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable

from backends.base import completion_limit
from backends.builtin.config import EngineConfig
from backends.builtin.core.detokenizer import Detokenizer
from backends.builtin.core.kv_cache import KVCacheManager
from backends.builtin.core.sampler import accept, sample
from backends.builtin.core.scheduler import ModelOutput, ScheduledBatch, Scheduler
from backends.builtin.core.sequence import Sequence
from backends.builtin.core.structured import Grammars
from backends.builtin.protocol import CoreInfo, SamplingParams, Stats, StepOutput
from backends.builtin.worker.loader import LoadedModel, load_model
from backends.builtin.worker.model_runner import ModelRunner


def check_request(limit: int, num_prompt_tokens: int, max_tokens: int | None) -> int:
    """A request's effective max_tokens under a context of `limit` tokens, or ValueError naming
    what does not fit (OverflowError when it is the context)."""
    if num_prompt_tokens == 0:
        raise ValueError("the prompt is empty")
    if num_prompt_tokens >= limit:
        raise OverflowError(
            f"This model's maximum context length is {limit} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, leaving no room for output."
        )
    max_tokens = completion_limit(max_tokens, limit, num_prompt_tokens)
    if num_prompt_tokens + max_tokens > limit:
        raise OverflowError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )
    return max_tokens


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.loaded = loaded or load_model(config.model or None, config.cache_dir, config.gguf_weights == "quantized")
        model_cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        num_blocks = config.blocks()
        self.max_model_len = min(config.max_model_len or model_cfg.max_position_embeddings,
                                 num_blocks * config.block_size)
        eos_token_ids = set(model_cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos_token_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv, self.eos_token_ids, self.max_model_len)
        self.runner = ModelRunner(self.loaded, config, num_blocks, self.max_model_len)
        self.steps = 0
        self.slot_steps = self.live_token_steps = 0  # KV slots allocated / holding live tokens, summed over steps
        self.live = 0  # live tokens after the last step: counted once per step, read by stats()
        self.adapters: dict[str, tuple[int, str]] = {}  # LoRA adapter name -> (its weights' id, path)
        self._adapter_ids = itertools.count(1)
        self._retired: set[int] = set()  # unloaded adapters' ids, their weights kept while a sequence runs them
        for name, path in config.adapters().items():
            self.add_adapter(name, path)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stop: Iterable[str] = (), cache_salt: str | None = None, adapter: str | None = None,
                    embed: bool = False, tenant: str | None = None) -> None:
        """Queue a request; `embed`: an embedding request (its prompt pooled by `pooling_type`, of the
        base model); `tenant`: whose it is (the scheduler takes tenants' waiting requests in turn).
        Validation (lengths, ids) is the caller's: see `check_request`. A duplicate id, an adapter
        not loaded or a grammar that does not compile is a ValueError."""
        if request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if embed:
            self.scheduler.add(Sequence(list(prompt_ids), params, request_id, cache_salt=cache_salt,
                                        pooling=self.config.pooling_type), tenant)
            return
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"the LoRA adapter {adapter!r} is not loaded")
        matcher = self.grammars.matcher(params.grammar) if params.grammar is not None else None
        detokenizer = Detokenizer(self.tokenizer, list(prompt_ids), tuple(stop), params.skip_special_tokens)
        self.scheduler.add(Sequence(list(prompt_ids), params, request_id, matcher=matcher, detokenizer=detokenizer,
                                    cache_salt=cache_salt, adapter_id=self.adapters[adapter][0] if adapter else 0),
                           tenant)

    # -- LoRA adapters ------------------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> None:
        """Serve an adapter under `name`; loading the same again is a no-op. ValueError where it
        cannot serve this model, or the name is taken by another path."""
        if name in self.adapters:
            if self.adapters[name][1] != path:
                raise ValueError(f"a LoRA adapter named {name!r} is loaded from another path: unload it first")
            return
        adapter_id = next(self._adapter_ids)  # new weights, new id: no cached prefix of an older one serves it
        self.runner.add_adapter(adapter_id, path)
        self.adapters[name] = (adapter_id, path)

    def remove_adapter(self, name: str) -> None:
        """Stop serving `name`; its running requests finish with its weights. ValueError where unknown."""
        if name not in self.adapters:
            raise ValueError(f"the LoRA adapter {name!r} is not loaded")
        self._retired.add(self.adapters.pop(name)[0])
        self._drop_retired()

    def _drop_retired(self) -> None:
        in_use = {seq.adapter_id for seq in (*self.scheduler.running, *self.scheduler.waiting,
                                             *self.scheduler.arrived)}
        for adapter_id in self._retired - in_use:
            self.runner.drop_adapter(adapter_id)
            self._retired.discard(adapter_id)

    def resident_adapters(self) -> tuple[str, ...]:
        """The adapters in compute slots now."""
        resident = self.runner.lora.resident if self.runner.lora is not None else {}
        return tuple(name for name, (adapter_id, _) in self.adapters.items() if adapter_id in resident)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Made on the first constrained request: llguidance is imported only where it is used."""
        return Grammars(self.tokenizer, self.loaded.config.vocab_size, sorted(self.eos_token_ids))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    @property
    def request_ids(self) -> list[str]:
        """The requests with a choice still generating."""
        return list(self.scheduler.requests)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def computed_prompt_tokens(self) -> int:
        """Prefill tokens actually run through the model."""
        return self.scheduler.computed_prompt_tokens

    def core_info(self) -> CoreInfo:
        return CoreInfo(self.max_model_len, self.kv.num_blocks, self.kv.block_size,
                        str(self.runner.dtype).removeprefix("torch."), self.runner.dtype_reason,
                        self.loaded.config.vocab_size, self.runner.weights, self.runner.weight_bytes_per_token)

    def live_tokens(self) -> int:
        """Tokens held in used KV blocks, a shared block counted once."""
        bs = self.kv.block_size
        filled: dict[int, int] = {}
        for seq in self.scheduler.running:
            for i, block in enumerate(seq.block_table):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        return sum(filled.values())

    def stats(self) -> Stats:
        """KV and scheduling figures. Reads live state: call it from the thread that runs steps."""
        kv, sched, bs = self.kv, self.scheduler, self.kv.block_size
        return {
            "running": len(sched.running), "waiting": sched.num_waiting,
            "kv_blocks_total": kv.num_blocks, "kv_blocks_used": kv.num_used, "kv_blocks_free": kv.num_free,
            "kv_blocks_cached": kv.num_cached,
            # Of the slots in allocated blocks, the fraction holding a live token (1.0 when none are).
            "kv_live_token_fraction": self.live / (kv.num_used * bs) if kv.num_used else 1.0,
            # Summed over steps, so that a run's average is a ratio of two deltas.
            "kv_slot_steps_total": self.slot_steps, "kv_live_token_steps_total": self.live_token_steps,
            "prefix_cache_queries_total": kv.query_tokens, "prefix_cache_hits_total": kv.hit_tokens,
            "kv_evictions_total": kv.evictions, "preemptions_total": sched.num_preemptions,
            "recomputed_tokens_total": sched.recomputed_tokens, "queue_delay_seconds_total": sched.queue_delay_sum,
            "admitted_requests_total": sched.num_admitted, "steps_total": self.steps,
            "lora_adapters_loaded": len(self.adapters),
            "lora_slot_loads_total": self.runner.lora.loads if self.runner.lora is not None else 0,
            # Speculative decoding: steps a sequence speculated in, its draft tokens, and those accepted.
            "spec_decode_drafts_total": sched.num_drafts, "spec_decode_draft_tokens_total": sched.num_draft_tokens,
            "spec_decode_accepted_tokens_total": sched.num_accepted_tokens,
        }

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            outputs = self.scheduler.update_from_output(batch, self._execute(batch))
        except BaseException:
            # Blocks registered for this step were never written: forget every cached prefix.
            self.kv.reset_prefix_cache()
            raise
        if self._retired:
            self._drop_retired()
        self.live = self.live_tokens()  # one walk over the block tables a step, for these and stats()
        self.slot_steps += self.kv.num_used * self.kv.block_size
        self.live_token_steps += self.live
        return outputs

    def _execute(self, batch: ScheduledBatch) -> ModelOutput:
        """The model's part of a step: the batch's forward pass, then a token for each sequence
        whose prompt is now computed (an embedding request's pooled hidden states instead). Each
        further choice of an n > 1 request is forked from its prompt here, to draw its first token
        from the same logits. A speculating sequence samples one row per draft and one more, and
        keeps its drafts up to the first its row rejects, then that row's token (`accept`)."""
        if self.kv.pending_copies:
            self.runner.copy_blocks(self.kv.pending_copies)
            self.kv.pending_copies.clear()
        done, logits, pooled = self.runner.run(batch)
        self.steps += 1
        forks = {seq: [seq.fork(i) for i in range(1, seq.params.n)] for seq in done
                 if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0}
        choices, to_sample, rows = [], [], []
        row = 0  # the sequence's first row of logits
        for seq in done:
            drafts = batch.drafts.get(seq, [])  # none where it forks: it drafts once it has output
            for choice in (seq, *forks.get(seq, ())):
                choices.append(choice)
                to_sample += [choice] + [choice.ahead(drafts[:i]) for i in range(1, len(drafts) + 1)]
                rows += range(row, row + 1 + len(drafts))
            row += 1 + len(drafts)
        sampled, logprobs = sample(logits[rows], to_sample, self.eos_token_ids) if to_sample else ([], [])
        tokens, token_logprobs, at = [], [], 0
        for choice in choices:
            drafts = batch.drafts.get(choice, [])
            emitted = accept(drafts, sampled[at : at + 1 + len(drafts)])
            tokens.append(emitted)
            token_logprobs.append([lp for lp in logprobs[at : at + len(emitted)] if lp is not None])
            at += 1 + len(drafts)
        return ModelOutput(choices, tokens, token_logprobs, forks, pooled)

    # -- offline helper -----------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 stop: Iterable[str] = ()) -> list[dict[int, list[int]]]:
        """Run prompts to completion; returns, per prompt, each choice's output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{id(self)}-{self.steps}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p, stop)
        outputs: dict[str, dict[int, list[int]]] = {rid: {} for rid in ids}
        while self.has_work:
            for out in self.step():
                outputs[out.request_id].setdefault(out.index, []).extend(out.token_ids)
        return [outputs[rid] for rid in ids]

    def embed(self, prompts: list[list[int]], cache_salt: str | None = None) -> list[list[float]]:
        """Embed prompts (all in the engine at once); returns their vectors in order."""
        ids = [f"offline-embed-{id(self)}-{self.steps}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, SamplingParams(), cache_salt=cache_salt, embed=True)
        vectors: dict[str, list[float]] = {}
        while self.has_work:
            vectors |= {out.request_id: out.embedding for out in self.step() if out.embedding is not None}
        return [vectors[rid] for rid in ids]
