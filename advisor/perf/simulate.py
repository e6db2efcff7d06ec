"""A workload through one engine, step by step, as its runtime's scheduler runs it.

Requests arrive (all at once, a closed loop of `concurrency` clients, Poisson at a rate, or a
trace); each step the scheduler (`schedulers`) picks the decodes and prefill chunks it carries,
within its sequence limit, its token budget and the KV cache (preempting the newest sequence and
recomputing it later when the cache runs out, or admitting only what is sure to fit); `steps`
says what the step costs; the clock moves on. Between events (an arrival, a prefill finishing, a
sequence finishing, the cache filling) a decode-only batch does not change, so those steps are
taken together, costed at their mean context: thousands of requests simulate in milliseconds.

Data-parallel ranks split the traffic evenly: one rank is simulated with its share."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field, replace

from .schedulers import Scheduler
from .steps import Step, StepCost

# Requests' lengths vary around a workload's means (uniformly within +-50%) where only the means are
# known, as real traffic's do: with every request alike, a closed loop's clients finish together and
# arrive in waves.
TRAFFIC_SPREAD = 0.5


@dataclass(frozen=True)
class Traffic:
    prompt: int
    output: int
    load: str = "concurrency"  # offline | concurrency | rate | trace
    concurrency: int = 1
    rate: float = 0.0  # requests/s, Poisson
    requests: int = 400
    prefix_reuse: float = 0.0  # share of each prompt found in the prefix cache
    handed_over: bool = False  # prompts arrive prefilled (a disaggregated decode engine): only decoding here
    spread: float = 0.0  # lengths drawn uniformly within (1 +- spread) x the means: real traffic's finishes stagger
    trace: tuple[tuple[float, int, int], ...] = ()  # (arrival s, prompt, output) when load == "trace"
    seed: int = 0

    def share(self, ranks: int) -> Traffic:
        """One of `ranks` data-parallel ranks' share."""
        if ranks == 1:
            return self
        return replace(self, concurrency=max(1, math.ceil(self.concurrency / ranks)), rate=self.rate / ranks,
                       requests=max(1, self.requests // ranks), trace=self.trace[::ranks])


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    cached: int = 0  # prompt tokens whose KV is already there (a prefix-cache hit, or handed over)
    order: int = 0  # admission order: the newest is preempted first
    prefilled: int = 0
    generated: float = 0.0
    first: float | None = None
    done: float | None = None
    offset: float = 0.0  # context = offset + the decode clock, while decoding
    key: int = -1  # while decoding, its entry in `decoding` and the finishing heap (a fresh one each time)


@dataclass
class Outcome:
    """Per-request timings (seconds) and totals of one simulation."""
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    output_tokens: float = 0.0
    prompt_tokens: float = 0.0
    duration: float = 0.0
    rejected: int = 0  # prompts the cache could never hold
    preemptions: int = 0
    finished: list[tuple[float, float | None]] = field(default_factory=list)  # each request's (TTFT, TPOT)

    @property
    def completed(self) -> int:
        return len(self.e2e)


def simulate(cost: StepCost, sched: Scheduler, kv_tokens: int, traffic: Traffic, accepted: float = 1.0) -> Outcome:
    """One rank's run; `accepted`: tokens a decode step yields (speculative decoding's mean
    accepted draft tokens plus one)."""
    rng = random.Random(traffic.seed)
    arrivals = _arrivals(traffic, rng)
    total = len(arrivals)
    future = deque(sorted(arrivals, key=lambda r: r.arrival))
    waiting: deque[Request] = deque()
    prefilling: list[Request] = []
    decoding: dict[int, Request] = {}
    finishing: list[tuple[float, int]] = []  # (decode clock at which it finishes, key): ties break in order
    keys = itertools.count()
    out = Outcome()
    clock = g = 0.0  # wall clock; decode clock (tokens every decoding sequence has advanced)
    # Sums over the decoding requests, so that the KV they hold is known without a pass over them:
    # each one's context is its offset + g.
    offsets = prompts = outputs = 0.0
    order = 0
    issued = len(arrivals)
    closed = traffic.load == "concurrency"
    share = sched.reserve_output
    # After a preemption nothing new is admitted until a sequence finishes (vLLM admits nothing in
    # a step that preempted; SGLang raises its reserve ratio after a retraction): else the victim
    # would be readmitted and preempted again, step after step.
    held = False

    def kv_used() -> float:
        return offsets + len(decoding) * g + sum(r.prefilled for r in prefilling)

    def kv_promised() -> float:
        """What running sequences are still expected to add, as far as the scheduler reserves it."""
        if not share:
            return 0.0
        generated = offsets + len(decoding) * g - prompts
        return share * (outputs - generated + sum(r.prompt - r.prefilled + r.output for r in prefilling))

    def needs(r: Request) -> float:
        return r.prompt + 1 + share * r.output

    def finish(r: Request) -> None:
        nonlocal issued, held
        held = False
        r.done = clock
        out.e2e.append(r.done - r.arrival)
        out.ttft.append(r.first - r.arrival)
        tpot = (r.done - r.first) / (r.output - 1) if r.output > 1 else None
        if tpot is not None:
            out.tpot.append(tpot)
        out.finished.append((r.first - r.arrival, tpot))
        out.output_tokens += r.output
        if closed and issued < traffic.requests:  # its client sends the next one
            issued += 1
            future.appendleft(_request(traffic, clock, rng))

    def start_decoding(r: Request) -> None:
        nonlocal offsets, prompts, outputs
        r.offset = r.prompt + r.generated - g
        offsets, prompts, outputs = offsets + r.offset, prompts + r.prompt, outputs + r.output
        r.key = next(keys)
        decoding[r.key] = r
        heapq.heappush(finishing, (g + (r.output - r.generated), r.key))

    def stop_decoding(r: Request) -> None:
        nonlocal offsets, prompts, outputs
        del decoding[r.key]
        offsets, prompts, outputs = offsets - r.offset, prompts - r.prompt, outputs - r.output

    def preempt_newest() -> None:
        nonlocal held
        held = True
        out.preemptions += 1
        victim = max((*prefilling, *decoding.values()), key=lambda r: r.order)
        if victim.key in decoding and decoding[victim.key] is victim:
            stop_decoding(victim)
            victim.generated = victim.offset + g - victim.prompt
        else:
            prefilling.remove(victim)
        done = int(victim.generated)
        victim.prompt, victim.output, victim.prefilled, victim.generated = (
            victim.prompt + done, victim.output - done, 0, 0.0)  # recomputed when it returns
        waiting.appendleft(victim)

    frontend = cost.frontend  # the server's own time per request (HTTP, template, tokenizer) before it is queued
    while out.completed + out.rejected < total or (closed and out.completed + out.rejected < issued):
        while future and future[0].arrival + frontend <= clock:
            waiting.append(future.popleft())
        running = len(prefilling) + len(decoding)
        if not running and not waiting:
            if not future:
                break
            clock = future[0].arrival + frontend
            continue
        used = kv_used()
        free = kv_tokens - used - kv_promised()
        if waiting and not running and needs(waiting[0]) > kv_tokens:
            out.rejected += 1
            waiting.popleft()
            continue
        # -- what this step carries
        prefill_first = sched.policy == "prefill_first" and (prefilling or (
            waiting and not held and running < sched.max_seqs and needs(waiting[0]) <= free))
        decodes = 0 if prefill_first else len(decoding)
        if decodes and kv_tokens - used < decodes * accepted:
            preempt_newest()
            continue
        budget = sched.step_tokens - decodes
        chunks: list[tuple[Request, int]] = []
        if not decodes or sched.policy == "mixed":
            for r in prefilling:
                if budget <= 0:
                    break
                n = min(r.prompt - r.prefilled, budget) if sched.chunked else r.prompt - r.prefilled
                chunks.append((r, n))
                budget -= n
            while waiting and not held and budget > 0 and running < sched.max_seqs:
                need = needs(waiting[0])
                if need > free:
                    break
                r = waiting.popleft()
                if not sched.chunked and r.prompt > budget and chunks:
                    waiting.appendleft(r)
                    break
                order += 1
                r.order = order
                r.prefilled = r.cached
                prefilling.append(r)
                n = min(r.prompt - r.prefilled, budget) if sched.chunked else r.prompt - r.prefilled
                chunks.append((r, n))
                budget -= n
                running += 1
                free -= need
        if not decodes and not chunks:  # the cache holds nothing more until a sequence finishes
            if not decoding:
                out.rejected += 1
                waiting.popleft()
                continue
            decodes = len(decoding)
        # -- how many identical decode-only steps can be taken at once
        steps = 1
        if decodes and not chunks:
            limits = [finishing[0][0] - g if finishing else 1.0]
            if share < 1:
                limits.append(max(1.0, (kv_tokens - used) / decodes))
            steps = max(1, math.floor(min(limits) / accepted))
        mean_context = offsets + decodes * (g + (steps - 1) * accepted / 2) if decodes else 0.0
        cells = mean_context + sum(r.prefilled for r in prefilling)
        step = Step(decodes=decodes, decode_context=mean_context, prefill=sum(n for _, n in chunks),
                    prefill_context=sum(n * (r.prefilled + n / 2) for r, n in chunks),
                    attended=decodes * cells if sched.unified_kv else None)
        seconds = cost.seconds(step)
        if future and steps > 1 and future[0].arrival + frontend > clock:
            steps = max(1, min(steps, math.ceil((future[0].arrival + frontend - clock) / seconds)))
        clock += seconds * steps
        if decodes:
            g += steps * accepted
        out.prompt_tokens += step.prefill
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.prompt:
                prefilling.remove(r)
                if r.first is None:
                    r.first = clock
                    r.generated = 1.0
                if r.generated >= r.output:
                    finish(r)
                else:
                    start_decoding(r)
        while finishing and finishing[0][0] <= g + 1e-9:
            _, key = heapq.heappop(finishing)
            r = decoding.get(key)
            if r is None:
                continue  # a stale entry: its request was preempted
            stop_decoding(r)
            finish(r)
    out.duration = clock
    return out


def _request(traffic: Traffic, at: float, rng: random.Random, prompt: int | None = None,
             output: int | None = None) -> Request:
    if prompt is None and traffic.spread:
        prompt = round(traffic.prompt * rng.uniform(1 - traffic.spread, 1 + traffic.spread))
        output = round(traffic.output * rng.uniform(1 - traffic.spread, 1 + traffic.spread))
    prompt = max(1, prompt or traffic.prompt)
    cached = prompt - 1 if traffic.handed_over else min(prompt - 1, round(prompt * traffic.prefix_reuse))
    return Request(arrival=at, prompt=prompt, output=max(1, output or traffic.output), cached=cached)


def _arrivals(traffic: Traffic, rng: random.Random) -> list[Request]:
    if traffic.load == "trace":
        return [_request(traffic, t, rng, p, o) for t, p, o in traffic.trace]
    if traffic.load == "rate":
        t, out = 0.0, []
        for _ in range(traffic.requests):
            t += rng.expovariate(traffic.rate)
            out.append(_request(traffic, t, rng))
        return out
    first = traffic.requests if traffic.load == "offline" else min(traffic.concurrency, traffic.requests)
    return [_request(traffic, 0.0, rng) for _ in range(first)]
