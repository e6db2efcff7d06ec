"""The gateway's shared state, one per process: who may call (directory), how much (quotas),
what they used (ledger), what it can send to (the fleet) and where each request goes (the
router), and what it all looks like (metrics). A request runs as a `Call` inside `Gateway.call`,
whose end settles it: its one `Outcome` is handed on to the ledger, quota settlement, metrics,
the canary guard and shadow comparison."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import UTC, datetime

from sqlalchemy import Engine

from backends.base import (
    NANO_USD_PER_USD,
    SPECIAL_TOKENS,
    Adapter,
    Backend,
    BackendError,
    ContextTooLong,
    Embeddings,
    EmbedRequest,
    GenerateRequest,
    InvalidRequest,
    TokenSpan,
    Usage,
)
from gateway.errors import GatewayError
from gateway.inference.admission import Admission
from gateway.inference.call import Call, Outcome, Received, Shared, refusal
from gateway.inference.fleet import Breaker, Fleet
from gateway.inference.routing import Decision, RequestFacts, Router
from gateway.operations.telemetry import GatewayMetrics
from gateway.operations.tracing import OFF, RequestTrace, decided
from gateway.rollout import shadow
from gateway.rollout.canary import CanaryGuard
from gateway.settings import Settings
from gateway.tenancy import budgets, ledger
from gateway.tenancy.auth import AdapterView, Directory, Principal
from gateway.tenancy.ledger import UsageLedger
from gateway.tenancy.quotas import (
    MemoryQuotaStore,
    QuotaExceeded,
    QuotaLimits,
    QuotaStore,
    RedisQuotaStore,
    Reservation,
    Spent,
)
from policies.rollout import ROLLOUT, load_rollout

log = logging.getLogger("servegate.gateway")
requests_log = logging.getLogger("servegate.requests")
RECOUNT_TIMEOUT_S = 5.0
RESTART_S = (0.5, 30.0)  # a background task that died waits this long before its restart, doubling
SETTLE_WAIT_S = 0.5  # how long the end of an answer waits for its quota settlement (Redis may be slow)


class Gateway:
    def __init__(self, backends: dict[str, Backend], settings: Settings, db: Engine) -> None:
        self.settings, self.db = settings, db
        self.fleet = Fleet(backends, Breaker(settings.breaker_failures, settings.breaker_cooldown_s),
                           lambda: Admission(settings.max_in_flight, settings.max_queued, settings.queue_timeout_s))
        self.router = Router(self.fleet, settings.route_seed, adapters=lambda name: self.directory.adapters.get(name))
        self.directory = Directory(db, settings)
        self.quotas: QuotaStore = RedisQuotaStore(
            settings.redis_url, settings.quota_lease_s, history=self._spent, fail=settings.quota_redis_down,
        ) if settings.redis_url else MemoryQuotaStore()
        self.ledger = UsageLedger(db, settings.spool_dir, settings.usage_flush_s)
        self.metrics = GatewayMetrics()
        self.metrics.saturation.set_function(lambda: self.fleet.saturation)
        self.metrics.quarantined.set_function(lambda: self.ledger.quarantined)
        self.shared = Shared(self.fleet, self.quotas, self.metrics, settings, self._reserved)
        self._tasks: set[asyncio.Task] = set()
        self._shadows: dict[str, asyncio.Task[Outcome | None]] = {}  # request id -> its mirror, till the primary ends
        self._open: dict[str, Call] = {}  # billed calls not yet settled, checkpointed while they run
        self.down: dict[str, str] = {}  # background tasks that died and wait for their restart -> why
        self.canary = CanaryGuard(self.router, db, self.metrics, load_rollout(settings.rollout_policy or ROLLOUT))
        self.launched: dict[str, AdapterView] = {}  # adapters the served models' backends serve from launch
        self.failed_to_start: dict[str, str] = {}  # served model -> why its backend did not start

    async def start(self) -> None:
        await asyncio.to_thread(self.directory.load)  # the first read must succeed: no keys, no service
        self.launched = await self._launched_adapters()
        self.load_routes()
        await self._recover()  # what stopped processes used is in the ledger before windows are rebuilt from it
        if isinstance(self.quotas, MemoryQuotaStore):
            self.quotas.seed(await self._spent())
        self.spawn(self.directory.run())
        self.spawn(self._unload_stale_adapters())
        self.supervise("usage ledger writer", self.ledger.run)
        self.supervise("usage checkpoints", self._checkpoints)
        self.supervise("spool recovery", self._recoveries)
        self.supervise("quota leases", self.quotas.run)
        self.spawn(self._refresh_routes())
        self.spawn(self.fleet.watch(self.router.targets, self.settings.load_poll_s))
        self.spawn(self.canary.run())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self._tasks)
        await asyncio.to_thread(self.ledger.close)
        await self.quotas.close()

    def spawn(self, coroutine) -> asyncio.Task:
        """Run in the background, holding a reference until done."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def supervise(self, name: str, run: Callable[[], Coroutine]) -> None:
        """Run a background loop for the gateway's life: one that dies is logged, named in `down`
        (which turns /ready unready) and started again after a growing pause."""

        async def supervised() -> None:
            pause = RESTART_S[0]
            while True:
                try:
                    await run()
                    return
                except Exception as exc:
                    self.down[name] = f"{type(exc).__name__}: {exc}"
                    log.exception("%s died; restarting it in %.1f s", name, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, RESTART_S[1])
                self.down.pop(name, None)

        self.spawn(supervised())

    # -- usage that outlives a process --------------------------------------------------------
    async def _spent(self) -> list[Spent]:
        """The ledger's totals for the quota windows now open."""
        return await asyncio.to_thread(ledger.spent, self.db, time.time())

    async def _recover(self) -> None:
        """Ingest the spools of stopped processes; the calls they had open are billed what they had
        delivered at their last checkpoint, and their reservations settle to what was billed."""
        recovered = await asyncio.to_thread(self.ledger.recover_orphans)
        for record in recovered.open_calls:
            if record.get("reservation"):
                self.spawn(self.quotas.release(Reservation.of(record["reservation"]),
                                               record["prompt_tokens"] + record["completion_tokens"],
                                               record["cost_nano_usd"]))

    async def _recoveries(self) -> None:
        """Other replicas sharing the spool directory may die while this one runs; a dead one's
        spool waits for a database that cannot be reached (no fault of this task's)."""
        while True:
            await asyncio.sleep(self.settings.recover_s)
            try:
                await self._recover()
            except ledger.UNREACHABLE as exc:
                log.warning("spool recovery waits for the database: %s", str(exc).splitlines()[0])

    async def _checkpoints(self) -> None:
        """What each open call has used so far, written beside the spool every `checkpoint_s`, on the
        event loop: a call's first checkpoint, taken as it reserves (`_reserved`), is never lost to a
        rewrite from an older list of calls."""
        while True:
            await asyncio.sleep(self.settings.checkpoint_s)
            self.ledger.checkpoint([self._checkpoint_row(outcome) for outcome in
                                    (call.checkpoint() for call in list(self._open.values())) if outcome is not None])

    def _reserved(self, checkpoint: Outcome) -> None:
        """A billed call's first checkpoint, the moment it holds a reservation: a call that ends between
        two rewrites (a short one, a batch's line) is billed and released too should this process die."""
        self.ledger.opened(self._checkpoint_row(checkpoint))

    def _checkpoint_row(self, checkpoint: Outcome) -> dict:
        return self._row(checkpoint) | {"reservation": checkpoint.reservation.as_dict()}

    def visible_models(self, principal: Principal) -> list[str]:
        return [m for m in self.router.models() if principal.may_use(m)]

    async def _launched_adapters(self) -> dict[str, AdapterView]:
        """The adapters a served model's backend serves from its launch (the engine's `--lora`,
        vLLM's `--lora-modules`), open to every tenant that may use the model, as the runtime serves
        them to every client. Only those: one loaded later for a registered adapter stays that
        adapter's tenants' even after its registration is gone."""
        launched = {}
        for model, backend in self.fleet.served.items():
            with contextlib.suppress(Exception):  # a backend that cannot say serves none
                for name in (await backend.capabilities()).adapters:
                    launched.setdefault(name, AdapterView(Adapter(name, ""), model, None, frozenset(), QuotaLimits(),
                                                          everyone=True))
        return launched

    async def _unload_stale_adapters(self) -> None:
        """Adapters unregistered or moved are unloaded from the backends this replica loaded them on,
        once its directory says so."""
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            await self.fleet.unload_stale(lambda name: view.adapter if (view := self.directory.adapters.get(name))
                                          else None)

    def usable_adapter(self, principal: Principal, name: str | None) -> AdapterView | None:
        """The LoRA adapter `name` names, where the caller may use it: its tenant's own or one shared
        with it (or one its backend serves from launch), on a base it may use and this gateway serves;
        else None. A served model or route alias of the same name wins over an adapter, a registered
        adapter over one served from launch."""
        adapter = self.directory.adapters.get(name or "") or self.launched.get(name or "")
        models = self.router.models()
        if adapter is None or name in models or adapter.base not in models or not principal.may_use(adapter.base) \
                or not adapter.allows(principal.tenant.name):
            return None
        return adapter

    def usable_adapters(self, principal: Principal) -> list[AdapterView]:
        names = sorted({*self.directory.adapters, *self.launched})
        return [a for name in names if (a := self.usable_adapter(principal, name))]

    def cache_salt(self, principal: Principal) -> str | None:
        """The caller's prefix-cache namespace; None where tenants share the cache."""
        return None if self.settings.shared_prefix_cache else prefix_cache_salt(principal.tenant.name)

    def resolve(self, principal: Principal, model: str | None, prompt: str = "", max_tokens: int | None = None,
                stream: bool = False, trace: RequestTrace = OFF) -> Decision:
        """Where the request goes. A model naming an adapter the caller may use routes as the
        adapter's base, with the adapter; one it may not use is not found, as an unknown model."""
        adapter = self.usable_adapter(principal, model)
        facts = RequestFacts(principal.tenant.name, principal.tenant.tier, prompt, max_tokens or 0, stream,
                             adapter.name if adapter else None, self.cache_salt(principal))
        with trace.step("gateway.route") as span:
            decision = self.router.resolve(adapter.base if adapter else model, self.visible_models(principal), facts)
            if adapter is not None and decision.adapter is not None:
                raise InvalidRequest(f"the LoRA adapter {adapter.name!r} applies to {adapter.base!r}, whose route "
                                     f"applies the adapter {decision.adapter.name!r} itself", param="model")
            decision.adapter = decision.adapter or adapter
            if span.is_recording():
                span.set_attributes(decided(decision))
        return decision

    # -- requests -----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def call(self, principal: Principal, decision: Decision, request: GenerateRequest, api: str,
                   stream: bool, trace: RequestTrace = OFF) -> AsyncIterator[Call]:
        """A request's whole life: the block runs its `Call`; the block's end closes it and settles
        its outcome (the one place a call is settled). When the decision mirrors the request, its
        shadow runs at the same time, through the same admission and timeouts, unbilled (and
        untraced). An answer that finished waits (briefly) for its quota settlement before the
        block ends, so a client that sends its next request on seeing the end finds its slot free."""
        request = dataclasses.replace(request, max_tokens=self._max_tokens(principal, request.max_tokens),
                                      cache_salt=self.cache_salt(principal) or request.cache_salt,
                                      tenant=principal.tenant.name,
                                      adapter=decision.adapter.name if decision.adapter else None)
        if decision.shadow is not None:
            mirrored = Call(self.shared, principal, dataclasses.replace(decision, candidates=[decision.shadow]),
                            dataclasses.replace(request, request_id=f"{request.request_id}-shadow"), api, stream,
                            billed=False, keep_text=True)
            self._shadows[request.request_id] = self.spawn(self._mirror(mirrored))
        call = Call(self.shared, principal, decision, request, api, stream, keep_text=decision.shadow is not None,
                    trace=trace)
        self._open[request.request_id] = call
        try:
            async with call:
                yield call
        finally:
            self._open.pop(request.request_id, None)
            settling = self._settle(call)
        if settling is not None and call.outcome.status == "ok":
            await asyncio.wait({settling}, timeout=SETTLE_WAIT_S)

    @staticmethod
    def _max_tokens(principal: Principal, asked: int | None) -> int | None:
        """The request's max_tokens under its key's limit per request (the limit where none is asked)."""
        cap = principal.max_tokens_per_request
        if cap is not None and asked is not None and asked > cap:
            raise GatewayError(400, f"max_tokens {asked} exceeds this key's limit of {cap} tokens per request.",
                               "invalid_request_error", code="max_tokens_exceeded", param="max_tokens")
        return cap if asked is None else asked

    async def _mirror(self, call: Call) -> Outcome | None:
        """A shadow's call run to its end, for nobody: its outcome is what the primary's settlement
        compares."""
        async with call:
            with contextlib.suppress(Exception):
                await call.open()
                async for _ in call.rest():
                    pass
        return call.outcome

    async def tokenize(self, principal: Principal, decision: Decision, text: str) -> list[TokenSpan]:
        """A text's tokens by the model's backend, charged to the caller's quotas as a prompt is: one
        request, and its tokens (reserved at their cheap lower bound, settled to the count). A text
        past the model's context is refused before it is tokenized."""
        backend = decision.candidates[0]
        request = GenerateRequest(request_id=f"tokenize-{uuid.uuid4().hex}", model=decision.model, prompt=text)
        at_least, context = backend.min_prompt_tokens(request), (await backend.capabilities()).max_context
        if context and at_least > context:
            raise ContextTooLong(f"The inputs hold at least {at_least} tokens, more than the model's context of "
                                 f"{context} tokens.", param="inputs")
        try:
            reservation = await self.quotas.reserve(principal.quota_scopes(decision.adapter), at_least)
        except QuotaExceeded as exc:
            self.metrics.quota_rejections.labels(principal.tenant.name, exc.limit).inc()
            raise refusal(exc, at_least, 0) from None
        counted = 0
        try:
            spans = await backend.tokenize(text)
            counted = len(spans)
        finally:
            self.spawn(self.quotas.settle(reservation, counted))
        if context and counted > context:
            raise ContextTooLong(f"The inputs hold {counted} tokens, more than the model's context of {context} "
                                 "tokens.", param="inputs")
        return spans

    async def embed(self, principal: Principal, decision: Decision, request: EmbedRequest,
                    api: str = "embeddings") -> Embeddings:
        """Vectors from the first of the model's backends that embeds (the next one where it fails
        retryably), billed as a prompt: reserved at an upper bound of the inputs' tokens, settled
        and recorded (one ledger row, api `embeddings`) at the backend's count. A client that leaves
        once the inputs reached a backend is billed them, counted by that backend where it can."""
        started, started_at = time.monotonic(), datetime.now(UTC)
        request = dataclasses.replace(request, model=decision.model, cache_salt=self.cache_salt(principal),
                                      tenant=principal.tenant.name)
        candidates = [b for b in decision.candidates if (await b.capabilities()).embeddings]
        if not candidates:
            raise InvalidRequest(f"the model {decision.asked!r} does not serve embeddings", param="model")
        bound = sum(len(x) if isinstance(x, tuple) else len(x.encode()) + SPECIAL_TOKENS for x in request.inputs)
        price = self.settings.price(decision.model, (await candidates[0].capabilities()).price, api)
        try:
            reservation = await self.quotas.reserve(principal.quota_scopes(), bound,
                                                    price.cost(bound, 0) if price else 0)
        except QuotaExceeded as exc:
            self.metrics.quota_rejections.labels(principal.tenant.name, exc.limit).inc()
            raise refusal(exc, bound, 0) from None
        texts = [x if isinstance(x, str) else "" for x in request.inputs]
        recorded = GenerateRequest(request_id=request.request_id, model=decision.model, prompt="\n".join(texts))
        tried: list[str] = []
        status, error, usage, recount = "cancelled", None, Usage(0, 0), None
        try:
            for number, backend in enumerate(candidates, 1):
                try:
                    async with self.fleet.attempt(backend.name, request.tenant):
                        tried.append(backend.name)
                        result = await backend.embed(request)
                except BackendError as exc:
                    if not exc.retryable or number == len(candidates):
                        raise
                    continue
                status, usage = "ok", Usage(min(max(result.prompt_tokens, 0), bound), 0)
                return result
        except BackendError as exc:
            status, error = "error", exc.code
            raise
        finally:
            if status == "cancelled" and tried:  # gone once the inputs reached a backend: they are billed
                usage, recount = Usage(bound, 0), Received()
            self._record(Outcome(
                request=recorded, principal=principal, decision=decision, api=api, stream=False,
                status=status, error=error, usage=usage, backend=tried[-1] if tried else "", tried=tuple(tried),
                ttft_ms=None, latency_ms=(time.monotonic() - started) * 1000, started_at=started_at,
                finished_at=datetime.now(UTC), reservation=reservation, price=price, recount=recount))

    def _settle(self, call: Call) -> asyncio.Task | None:
        """A call's end: its outcome handed on. A call refused before it reached a backend (quota,
        limits) has none; only its shadow is dropped. Returns the quota settlement under way, if any."""
        if call.outcome is None:
            mirrored = self._shadows.pop(call.request.request_id, None)
            if mirrored is not None:
                mirrored.cancel()
            return None
        outcome = call.outcome
        with call.trace.step("gateway.settle", **{
                "servegate.status": outcome.status, "gen_ai.usage.input_tokens": outcome.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": outcome.usage.completion_tokens}):
            return self._record(outcome)

    def _record(self, outcome: Outcome) -> asyncio.Task | None:
        """Text that came without token ids from a stream that never finished is tokenized first
        (in the background: the client is gone or failed already)."""
        if outcome.recount is not None:
            self.spawn(self._settle_recounted(outcome))
            return None
        tenant, model, usage = outcome.principal.tenant.name, outcome.decision.model, outcome.usage
        adapter = outcome.decision.adapter.name if outcome.decision.adapter else ""
        record = self._row(outcome)
        self.ledger.record(record)
        settling = self.spawn(self._settle_quotas(outcome)) if outcome.reservation is not None else None
        self.canary.observe(outcome.decision, outcome.status, outcome.ttft_ms, outcome.latency_ms,
                            usage.completion_tokens)
        mirrored = self._shadows.pop(outcome.request_id, None)
        if mirrored is not None and outcome.status == "ok":  # both answers side by side
            self.spawn(shadow.record(self.db, outcome, mirrored))
        elif mirrored is not None:  # a failed or abandoned primary has nothing to compare with
            mirrored.cancel()
        m = self.metrics
        m.requests.labels(tenant, model, outcome.backend, outcome.status, adapter).inc()
        m.e2e.labels(model).observe(outcome.latency_ms / 1000)
        for kind in ("prompt", "completion", "cached"):
            m.tokens.labels(tenant, model, kind, adapter).inc(getattr(usage, f"{kind}_tokens"))
        m.spend.labels(tenant, model).inc(outcome.cost / NANO_USD_PER_USD)
        extra = {k: record[k] for k in ("request_id", "tenant", "model", "adapter", "status", "error_type",
                                         "prompt_tokens", "completion_tokens", "cost_nano_usd", "ttft_ms",
                                         "latency_ms")}
        extra["route"] = outcome.route
        if outcome.adapter_load_ms:
            extra["adapter_load_ms"] = outcome.adapter_load_ms
        if outcome.tried[:-1]:
            extra["failed_over"] = list(outcome.tried[:-1])
        if self.settings.log_prompts:
            extra["prompt"] = outcome.request.prompt or outcome.request.messages
        requests_log.info("request finished", extra=extra)
        return settling

    @staticmethod
    def _row(outcome: Outcome) -> dict:
        """An outcome as the ledger keeps it."""
        usage = outcome.usage
        return {
            "request_id": outcome.request_id, "tenant": outcome.principal.tenant.name,
            "key_prefix": outcome.principal.key_prefix, "model": outcome.decision.model, "backend": outcome.backend,
            "adapter": outcome.decision.adapter.name if outcome.decision.adapter else None,
            "route": _route_label(outcome.decision), "api": outcome.api, "stream": outcome.stream,
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens, "cost_nano_usd": outcome.cost, "ttft_ms": outcome.ttft_ms,
            "latency_ms": outcome.latency_ms, "status": outcome.status, "error_type": outcome.error,
            "started_at": outcome.started_at, "finished_at": outcome.finished_at,
        }

    async def _settle_quotas(self, outcome: Outcome) -> None:
        """Windows and budgets charged what the request used; a budget threshold crossed is alerted."""
        crossings = await self.quotas.settle(outcome.reservation, outcome.usage.total_tokens, outcome.cost)
        for crossing in crossings:
            await budgets.alert(crossing, self.settings.budget_webhook_url)

    async def _settle_recounted(self, outcome: Outcome) -> None:
        """A request that ended without its backend's usage, counted by the backend where it can:
        the prompt as the runtime counts it, the text sent without token ids tokenized; else the
        estimates stand. Never below one token per piece the client was sent."""
        usage, recount = outcome.usage, outcome.recount
        backend = self.fleet.backend(outcome.backend)
        if backend is not None:
            with contextlib.suppress(Exception):  # the reservation's count stands
                async with asyncio.timeout(RECOUNT_TIMEOUT_S):
                    prompt = await backend.exact_prompt_tokens(outcome.request)
                if prompt is not None:
                    usage = dataclasses.replace(usage, prompt_tokens=prompt)
            with contextlib.suppress(Exception):  # the estimate stands
                if recount.texts and (await backend.capabilities()).tokenize:
                    async with asyncio.timeout(RECOUNT_TIMEOUT_S):
                        counts = [len(await backend.tokenize(text)) for text in recount.choice_texts()]
                    usage = dataclasses.replace(usage, completion_tokens=recount.counted(sum(counts)))
        self._record(dataclasses.replace(outcome, usage=usage, recount=None))

    # -- routes -------------------------------------------------------------------------------
    def load_routes(self) -> None:
        """The route table from the database; this replica serves it from now on."""
        from sqlmodel import Session

        from gateway.rollout.route_versions import table

        with Session(self.db) as session:
            self.router.set_routes(table(session))

    async def _refresh_routes(self) -> None:
        """Deploys, promotions and rollbacks reach every replica within the refresh interval; if the
        database is down, the last table keeps serving."""
        while True:
            await asyncio.sleep(self.settings.refresh_s)
            try:
                await asyncio.to_thread(self.load_routes)
            except Exception as exc:  # the database is down: keep the last table
                log.warning("route refresh failed: %s", exc)


def _route_label(decision: Decision) -> str:
    return decision.model if decision.alias is None else f"{decision.alias}@{decision.version}"


def prefix_cache_salt(tenant: str) -> str:
    """A tenant's prefix-cache namespace, the same on every replica: 256 bits in base64url (the
    length vLLM asks of a salt). Clients cannot send one of their own, so knowing it gains nothing."""
    digest = hashlib.sha256(f"servegate prefix cache of tenant {tenant}".encode()).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
