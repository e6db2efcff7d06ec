"""The engine: a synchronous step core (`LLMEngine`) and its async front (`AsyncLLMEngine`).

`LLMEngine.step()` = schedule -> run the model -> sample -> detokenize and finish. The async
front runs steps on a thread of its own, so the event loop never waits on the model; requests
and aborts reach the thread through a queue and take effect at the next step boundary.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

from ..base import InvalidRequest, UpstreamError
from .config import EngineConfig
from .detokenizer import Detokenizer
from .kv_cache import KVCacheManager
from .loader import LoadedModel, load_model
from .model_runner import ModelRunner
from .sampler import Logprob, sample
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence
from .structured import Grammars

log = logging.getLogger("servegate.engine")

# A burst's requests reach the engine over a few milliseconds (each is templated and tokenized
# first). Stepping at the first of them would run it alone and keep the rest a whole step behind
# it, a prefill step where the first is a cold prompt; so after a request arrives the loop keeps
# taking arrivals until none has come for ARRIVAL_GAP_S, for at most ARRIVAL_WAIT_S.
ARRIVAL_GAP_S = 0.003
ARRIVAL_WAIT_S = 0.02


def arrival_deadline() -> float:
    return time.monotonic() + ARRIVAL_WAIT_S


def arrival_wait(added: bool, deadline: float) -> float:
    """Seconds the loop waits for another command: none before a request has arrived, then the
    gap, up to the deadline."""
    return max(0.0, min(ARRIVAL_GAP_S, deadline - time.monotonic())) if added else 0.0


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served to this choice
    logprobs: tuple[Logprob, ...] = ()  # one per token, where the request asked for them


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    detokenizers: dict[int, Detokenizer] = field(default_factory=dict)
    unfinished: int = 0  # choices still generating

    def __post_init__(self) -> None:
        self.unfinished = self.params.n


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
    if max_tokens is None:
        return limit - num_prompt_tokens
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
        self.loaded = loaded or load_model(config.model or None, config.cache_dir)
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
        self.scheduler = Scheduler(config, self.kv)
        self.runner = ModelRunner(self.loaded, config, num_blocks)
        self.requests: dict[str, Request] = {}
        self.computed_prompt_tokens = 0  # prefill tokens actually run through the model
        self.steps = 0
        self.slot_steps = self.live_token_steps = 0  # KV slots allocated / holding live tokens, summed over steps
        self.live = 0  # live tokens after the last step: counted once per step, read by stats()

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    stop: Iterable[str] = (), cache_salt: str | None = None) -> None:
        """Queue a request. Validation (lengths, ids) is the caller's: see `check_request`. A
        duplicate id or a grammar that does not compile is a ValueError."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(list(prompt_ids), params, request_id, cache_salt=cache_salt)
        if params.grammar is not None:
            seq.matcher = self.grammars.matcher(params.grammar)
        self.requests[request_id] = Request(request_id, list(prompt_ids), params, tuple(stop))
        self.scheduler.add(seq)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Made on the first constrained request: llguidance is imported only where it is used."""
        return Grammars(self.tokenizer, self.loaded.config.vocab_size, sorted(self.eos_token_ids))

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def live_tokens(self) -> int:
        """Tokens held in used KV blocks, a shared block counted once."""
        bs = self.kv.block_size
        filled: dict[int, int] = {}
        for seq in self.scheduler.running:
            for i, block in enumerate(seq.block_table):
                filled[block] = max(filled.get(block, 0), min(bs, max(0, seq.num_computed_tokens - i * bs)))
        return sum(filled.values())

    def stats(self) -> dict[str, float]:
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
        }

    # -- the step -----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        try:
            outputs = self._run(batch)
        except BaseException:
            # Blocks registered for this step were never written: forget every cached prefix.
            self.kv.reset_prefix_cache()
            raise
        self.live = self.live_tokens()  # one walk over the block tables a step, for these and stats()
        self.slot_steps += self.kv.num_used * self.kv.block_size
        self.live_token_steps += self.live
        return outputs

    def _run(self, batch) -> list[StepOutput]:
        if self.kv.pending_copies:
            self.runner.copy_blocks(self.kv.pending_copies)
            self.kv.pending_copies.clear()
        done, logits = self.runner.run(batch)
        self.steps += 1
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.computed_prompt_tokens += min(n, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += n
        to_sample, rows = [], []
        for row, seq in enumerate(done):
            group = [seq]
            if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                group += self.scheduler.fork(seq, seq.params.n)
            to_sample += group
            rows += [row] * len(group)
        if not to_sample:
            return []
        tokens, logprobs = sample(logits[rows], to_sample, self.eos_token_ids)
        return [out for seq, token, logprob in zip(to_sample, tokens, logprobs)
                if (out := self._append(seq, token, logprob))]

    def _append(self, seq: Sequence, token: int, logprob: Logprob | None = None) -> StepOutput | None:
        request = self.requests.get(seq.request_id)
        if request is None:  # aborted meanwhile
            return None
        seq.token_ids.append(token)
        params = seq.params
        reason = None
        grammar_done = seq.matcher is not None and seq.matcher.accept(token)  # every token advances it
        if grammar_done or (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        detok = request.detokenizers.get(seq.index)
        if detok is None:
            detok = request.detokenizers[seq.index] = Detokenizer(self.tokenizer, request.prompt_ids, request.stop)
        text, stopped = detok.add(token, final=reason is not None)
        if stopped:
            reason = "stop"
        if reason:
            self.scheduler.finish(seq, reason)
            request.unfinished -= 1
            if not request.unfinished:
                del self.requests[seq.request_id]
        return StepOutput(seq.request_id, seq.index, text, (token,), reason, seq.num_cached_tokens,
                          (logprob,) if logprob else ())

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


class EngineFront:
    """Each request's asyncio queue over an engine that steps elsewhere (a thread of this process,
    or the engine-core process): requests and aborts go in as commands, taking effect at the next
    step boundary; outputs come back to their streams."""

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stats: dict[str, float] = {}  # the engine's figures, refreshed at every step boundary

    async def stream(self, request_id: str, prompt_ids: list[int], params: SamplingParams, stop: Iterable[str] = (),
                     cache_salt: str | None = None) -> AsyncIterator[StepOutput | BaseException]:
        """Outputs of one request until every choice finished. Leaving early aborts it."""
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), out)
        self._send(("add", request_id, prompt_ids, params, tuple(stop), cache_salt))
        remaining = params.n
        try:
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finish_reason is not None
                yield item
        finally:
            self._streams.pop(request_id, None)
            if remaining:
                self._send(("abort", request_id))

    def _deliver(self, request_id: str, item: StepOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, out = target
            loop.call_soon_threadsafe(out.put_nowait, item)

    def _send(self, command: tuple) -> None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


def run_command(engine: LLMEngine, command: tuple) -> tuple[str, str] | None:
    """Apply one front command to the engine; a request it refuses comes back with the reason."""
    if command[0] == "add":
        _, request_id, prompt_ids, params, stop, cache_salt = command
        try:
            engine.add_request(request_id, prompt_ids, params, stop, cache_salt)
        except ValueError as exc:
            return request_id, str(exc)
    else:
        engine.abort(command[1])
    return None


def step_or_fail(engine: LLMEngine) -> tuple[list[StepOutput], list[str], str]:
    """One step: its outputs, or, when it raises, the requests it failed (aborted) and why."""
    try:
        return engine.step(), [], ""
    except Exception as exc:  # a broken step fails the requests in it, not the engine
        log.exception("engine step failed")
        failed = list(engine.requests)
        for request_id in failed:
            engine.abort(request_id)
        return [], failed, f"the engine step failed: {exc}"


class AsyncLLMEngine(EngineFront):
    """Runs `LLMEngine` steps on a background thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self.stats = engine.stats()
        self._thread = threading.Thread(target=self._loop, name="servegate-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopped:
            added, deadline = False, arrival_deadline()
            while True:
                try:
                    wait = arrival_wait(added, deadline)
                    command = self._inbox.get(timeout=wait) if wait else self._inbox.get_nowait()
                except queue.Empty:
                    break
                added |= command[0] == "add"
                if command[0] != "add" or command[1] in self._streams:  # not abandoned on the way
                    if refused := run_command(self.engine, command):
                        self._deliver(refused[0], InvalidRequest(refused[1]))
            self.stats = self.engine.stats()
            if not self.engine.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            outputs, failed, why = step_or_fail(self.engine)
            for request_id in failed:
                self._deliver(request_id, UpstreamError(why))
            for out in outputs:
                self._deliver(out.request_id, out)
