"""Prometheus `/metrics`: the gateway's own figures, and every backend's live load (KV cache and
scheduling figures included)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from backends.base import Load

from ..deps import GatewayDep

router = APIRouter(tags=["probes"])
PREFIX = "servegate_backend_"


class LoadCollector:
    """Exposes a snapshot of backend loads: the fixed fields as gauges, `details` by their names
    (`*_total` as counters)."""

    def __init__(self, loads: dict[str, Load]) -> None:
        self.loads = loads

    def collect(self):
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(name: str, model: str, value: float | None) -> None:
            if value is None:
                return
            if name not in families:
                kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
                families[name] = kind(PREFIX + name.removesuffix("_total"), name.replace("_", " "), labels=["model"])
            families[name].add_metric([model], float(value))

        for model, load in self.loads.items():
            add("kv_usage", model, load.kv_usage)
            add("prefix_hit_rate", model, load.prefix_hit_rate)
            for name, value in {"running": load.running, "waiting": load.waiting, **load.details}.items():
                add(name, model, value)
        yield from families.values()


@router.get("/metrics")
async def metrics(gateway: GatewayDep) -> Response:
    for model, admission in gateway.admission.items():
        gateway.metrics.queued.labels(model).set(admission.queued)
    loads = {model: await backend.load() for model, backend in gateway.router.backends.items()}
    backends = CollectorRegistry()
    backends.register(LoadCollector(loads))
    body = generate_latest(gateway.metrics.registry) + generate_latest(backends)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
