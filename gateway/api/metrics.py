"""Prometheus `/metrics`: the gateway's own figures, and every backend's live load (KV cache and
scheduling figures included). They name tenants, so they are not public: loopback clients
(a sidecar, a node agent) read them freely unless a scrape token is set; everyone else sends
`SERVEGATE_METRICS_TOKEN` as a bearer token."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from backends.base import Load
from gateway.api.deps import GatewayDep, credential
from gateway.errors import GatewayError

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


def _may_scrape(request: Request, token: str | None) -> bool:
    if token is not None:
        return hmac.compare_digest((credential(request) or "").encode(), token.encode())
    try:
        return request.client is not None and ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:  # not an IP address (a Unix socket's peer)
        return False


@router.get("/metrics")
async def metrics(request: Request, gateway: GatewayDep) -> Response:
    if not _may_scrape(request, gateway.settings.metrics_token):
        raise GatewayError(401, "Metrics need the scrape token (SERVEGATE_METRICS_TOKEN) as a bearer token, or a "
                           "loopback client when none is set.", "invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    for name, member in gateway.fleet.members.items():
        gateway.metrics.queued.labels(name).set(member.admission.queued)
    loads = {model: await backend.load() for model, backend in gateway.fleet.served.items()}
    backends = CollectorRegistry()
    backends.register(LoadCollector(loads))
    body = generate_latest(gateway.metrics.registry) + generate_latest(backends)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
