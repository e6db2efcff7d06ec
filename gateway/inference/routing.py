"""Which backend serves a request: a served model's own backend, or a route alias's version
(active, or the canary by its share) and, inside it, a target. The version's rules (CEL, in
policies/rules) exclude targets and rank the rest; targets are skipped while the fleet says they
are down or their circuit breaker is open; the choice is weighted, or the least loaded, or the
replica that last served the prompt's prefix; the other targets and the fallbacks follow as
retries. A request for a LoRA adapter goes first to the targets that hold it in their compute
slots, then to those that have it loaded, then to the others, least loaded first. One seeded
random generator makes every choice reproducible.

The router holds routing's own state only (the route table, the prefixes it placed, its random
generator); what it knows of the targets it reads from the fleet, and changes nothing there."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from backends.base import Backend, InvalidRequest, ModelNotFound
from backends.runtimes import matrix_of
from gateway.inference.fleet import Fleet
from gateway.rollout.route_versions import PrefixAware, RouteOut, RouteState, Target
from gateway.tenancy.auth import AdapterView
from policies import rules
from policies.matrix import matrices


@dataclass(frozen=True)
class RequestFacts:
    """What routing rules may look at, known before the request is sent."""
    tenant: str = ""
    tier: str = ""
    prompt: str = ""
    max_tokens: int = 0
    stream: bool = False
    adapter: str | None = None  # the LoRA adapter to apply
    cache_salt: str | None = None  # the prefix-cache namespace the request will run in


@dataclass
class Decision:
    model: str  # what the client asked for
    candidates: list[Backend]  # in the order to try them
    alias: str | None = None
    version: int | None = None
    variant: str = "direct"  # direct | active | canary
    reason: str = "served model"
    timeout_s: float | None = None  # the route's, over the gateway's request timeout
    shadow: Backend | None = None  # mirror this request to it
    adapter: AdapterView | None = None  # the LoRA adapter the client asked for, applied on `model`

    @property
    def asked(self) -> str:
        """The model as the client named it: the adapter's name where one applies."""
        return self.adapter.name if self.adapter else self.model

    def header(self, backend: str) -> str:
        """The `x-servegate-route` value once `backend` answered."""
        adapter = f"; adapter={self.adapter.name}" if self.adapter else ""
        if self.alias is None:
            return f"model={self.model}; backend={backend}{adapter}"
        return (f"alias={self.alias}; version={self.version}; variant={self.variant}; backend={backend}; "
                f"reason={self.reason}{adapter}")


@dataclass
class PrefixIndex:
    """Chained block hash -> the backend that last served a prompt with that prefix (bounded LRU)."""
    capacity: int = 100_000
    owners: OrderedDict = field(default_factory=OrderedDict)

    @staticmethod
    def chain(prompt: str, spec: PrefixAware, adapter: str | None = None, cache_salt: str | None = None) -> list[bytes]:
        """The prompt's chained block hashes, the chain started from its adapter and cache salt: the
        same text under another adapter or salt is another cache's, and must not be sent where that
        one was built."""
        hashes, previous = [], f"{adapter or ''}\0{cache_salt or ''}".encode()
        for i in range(min(spec.blocks, len(prompt) // spec.block_chars)):
            block = prompt[i * spec.block_chars:(i + 1) * spec.block_chars].encode()
            previous = hashlib.blake2b(previous + block, digest_size=16).digest()
            hashes.append(previous)
        return hashes

    def owner(self, hashes: list[bytes]) -> tuple[str | None, int]:
        """The backend holding the longest known prefix, and how many blocks long it is."""
        for depth in range(len(hashes), 0, -1):
            if (name := self.owners.get(hashes[depth - 1])) is not None:
                return name, depth
        return None, 0

    def remember(self, hashes: list[bytes], backend: str) -> None:
        for h in hashes:
            self.owners[h] = backend
            self.owners.move_to_end(h)
        while len(self.owners) > self.capacity:
            self.owners.popitem(last=False)


class Router:
    def __init__(self, fleet: Fleet, seed: int | None = None,
                 adapters: Callable[[str], AdapterView | None] = lambda name: None) -> None:
        """`adapters`: the registered LoRA adapter of a name, for the route versions that apply one."""
        self.fleet, self.adapters = fleet, adapters
        self.routes: dict[str, RouteState] = {}
        self.rng = random.Random(seed)
        self.prefixes = PrefixIndex()
        self.turns: dict[str, int] = {}  # round-robin: the last turn given, per route

    def models(self) -> list[str]:
        served = self.fleet.served
        return [*served, *(a for a in self.routes if a not in served)]

    def targets(self) -> set[str]:
        """The backends the live route versions name, whose load the fleet keeps fresh."""
        return {name for state in self.routes.values() for version in (state.active, state.canary)
                if version is not None for name in version.spec.backends()}

    def set_routes(self, routes: dict[str, RouteState]) -> None:
        """A refreshed route table; requests already running keep the backend they have."""
        self.routes = {alias: state for alias, state in routes.items()
                       if state.active is not None or state.canary is not None}

    def resolve(self, model: str | None, visible: list[str], facts: RequestFacts = RequestFacts()) -> Decision:
        """The backends for `model` among the `visible` ones (optional when only one is). Models
        the caller may not use are reported as missing, never as forbidden."""
        if not model and len(visible) == 1:
            model = visible[0]
        if model not in visible:
            raise ModelNotFound(f"The model `{model}` does not exist or you do not have access to it. "
                                f"Available: {', '.join(visible) or 'none'}.", param="model")
        if model in self.routes:
            return self._route(model, self.routes[model], facts)
        return Decision(model, [self.fleet.served[model]])

    # -- inside a route -----------------------------------------------------------------------
    def _route(self, alias: str, state: RouteState, facts: RequestFacts) -> Decision:
        version, variant = state.active, "active"
        if state.canary is not None and (version is None or self.rng.random() < (state.canary.share or 0.0)):
            version, variant = state.canary, "canary"
        adapter = None
        if version.spec.adapter is not None:
            adapter = self.adapters(version.spec.adapter)
            if adapter is None:  # unregistered since the deploy
                raise ModelNotFound(f"route {alias!r} version {version.version} applies the LoRA adapter "
                                    f"{version.spec.adapter!r}, which is not registered", param="model")
            facts = dataclasses.replace(facts, adapter=adapter.name)
        order, reason = self._order(alias, version, facts)
        mirror = version.spec.shadow
        shadow = self.fleet.backend(mirror.backend) if mirror and self.rng.random() < mirror.share else None
        return Decision(alias, order, alias, version.version, variant, reason, version.spec.timeout_s, shadow, adapter)

    def _order(self, alias: str, version: RouteOut, facts: RequestFacts) -> tuple[list[Backend], str]:
        spec, now = version.spec, time.monotonic()
        fleet = self.fleet
        targets = [t for t in spec.targets if t.backend in fleet]
        fallbacks = list(spec.fallbacks)
        # the prompt's chained block hashes, for prefix-aware choice and the rules' shared-prefix fact
        hashes = PrefixIndex.chain(facts.prompt, spec.prefix_aware or PrefixAware(), facts.adapter,
                                   facts.cache_salt) if spec.rules or spec.prefix_aware else []
        owner, depth = self.prefixes.owner(hashes)  # who served the longest known prefix, how many blocks
        ruled = ""
        if spec.rules:
            targets, fallbacks, ruled = self._apply_rules(alias, spec, facts, depth > 0, targets, fallbacks)
        open_ = [t for t in targets if not fleet[t.backend].available(now)]
        ready = [t for t in targets if t not in open_]
        first, reason = None, "weighted"
        # an adapter's request: the first is chosen among the targets readiest to serve it
        rank = {t.backend: fleet[t.backend].adapter_rank(facts.adapter) for t in ready} \
            if facts.adapter and spec.adapter_affinity else {}
        pool = [t for t in ready if rank[t.backend] == min(rank.values())] if rank else ready
        if pool and spec.prefix_aware is not None:
            first, reason = self._by_prefix(pool, spec.prefix_aware, hashes, owner, depth)
        if first is None and pool and spec.balance == "least-loaded":
            first = min(pool, key=lambda t: (fleet[t.backend].waiting, fleet[t.backend].kv_usage, -t.weight))
            reason = "least-loaded"
        if first is None and pool and spec.balance == "round-robin":
            self.turns[alias] = turn = self.turns.get(alias, -1) + 1
            first, reason = pool[turn % len(pool)], "round-robin"
        if first is None and pool:
            first = self.rng.choices(pool, weights=[t.weight for t in pool])[0]
        if rank:
            reason = f"adapter {('resident', 'loaded', 'not loaded')[rank[first.backend]]}; {reason}"
        # the rest by weight, or (an adapter's request) readiest to serve it, then least loaded
        rest = sorted((t for t in ready if t is not first),
                      key=lambda t: (rank[t.backend], fleet[t.backend].waiting) if rank else -t.weight)
        names = ([first.backend] if first else []) + [t.backend for t in rest] + fallbacks
        if not names:  # every target's breaker is open: try them anyway rather than refuse outright
            names, reason = [t.backend for t in targets] + fallbacks, "all targets failing"
        elif open_:
            reason += f"; skipped {','.join(t.backend for t in open_)} (down or circuit open)"
        if ruled:
            reason = f"{ruled}; {reason}"
        return [fleet[name].backend for name in dict.fromkeys(names) if name in fleet], reason

    def _by_prefix(self, ready, spec: PrefixAware, hashes: list[bytes], owner: str | None, depth: int):
        if not hashes:  # shorter than one block: nothing worth keeping together
            return None, "weighted"
        chosen = next((t for t in ready if t.backend == owner), None)
        waiting = {t.backend: self.fleet[t.backend].waiting for t in ready}
        least = min(waiting.values())
        if chosen is not None and waiting[owner] - least <= spec.max_extra_waiting:
            reason = f"prefix ({depth} blocks cached)"
        else:  # among the targets not overloaded (the least loaded one at least)
            overloaded = chosen is not None
            fit = [t for t in ready if waiting[t.backend] - least <= spec.max_extra_waiting]
            chosen = self.rng.choices(fit, weights=[t.weight for t in fit])[0]
            if overloaded:  # a detour: the prefix stays with its owner, or groups would flip-flop
                return chosen, "prefix owner overloaded; weighted"
            reason = "new prefix; weighted"
        self.prefixes.remember(hashes, chosen.backend)
        return chosen, reason

    def _apply_rules(self, alias: str, spec, facts: RequestFacts, shared_prefix: bool, targets: list[Target],
                     fallbacks: list[str]):
        """The version's rules over each (request, target): exclusions drop targets (and
        fallbacks), scores keep only the best-scored targets. Refuses the request, with every
        reason, when no target is left."""
        ruleset = rules.named(spec.rules)
        request = {"tenant": facts.tenant, "tier": facts.tier, "model": alias, "prompt_chars": len(facts.prompt),
                   "prompt_tokens": len(facts.prompt) // 4, "max_tokens": facts.max_tokens, "stream": facts.stream,
                   "shared_prefix": shared_prefix}
        excluded, scored = [], {}
        for name in dict.fromkeys([t.backend for t in targets] + fallbacks):
            fired = ruleset.evaluate({"request": request, "target": self._target_facts(name, spec)})
            if stop := next((f for f in fired if f.rule.kind == "exclude"), None):
                excluded.append(f"{stop.rule.id}: {stop.reason}")
                continue
            scored[name] = (sum(f.rule.score for f in fired), [f.rule.id for f in fired if f.rule.kind == "score"])
        kept = [t for t in targets if t.backend in scored]
        if not kept:
            raise InvalidRequest(f"no target of route {alias!r} can serve this request: {'; '.join(excluded)}")
        best = max(scored[t.backend][0] for t in kept)
        chosen = [t for t in kept if scored[t.backend][0] == best]
        why = sorted({rule for t in chosen for rule in scored[t.backend][1]})
        summary = "rules: " + ", ".join(why or ["none fired"]) + (f"; excluded {len(excluded)}" if excluded else "")
        return chosen, [f for f in fallbacks if f in scored], summary

    def _target_facts(self, name: str, spec) -> dict:
        member = self.fleet.members.get(name)
        caps = member.capabilities if member else None
        target = next((t for t in spec.targets if t.backend == name), None)
        matrix = matrices().get(matrix_of(caps.runtime) or "") if caps else None
        return {"backend": name, "runtime": caps.runtime if caps else "", "pool": target.pool if target else "",
                "max_context": caps.max_context if caps else 0, "prefix_caching": bool(caps and caps.prefix_caching),
                "maintained": matrix is None or matrix.maintained.status == "yes",
                "waiting": member.waiting if member else 0, "kv_usage": member.kv_usage if member else 0.0}
