"""Prometheus metrics of the gateway itself, and JSON logs.

Logs carry request ids, tenants, models and figures; never a key, and prompts only when
`SERVEGATE_LOG_PROMPTS` is set."""

from __future__ import annotations

import json
import logging
import math
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank percentile (a value that occurred), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(math.ceil(q / 100 * len(ordered)) - 1, 0))]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        # `adapter`: the LoRA adapter applied, "" for the base model
        self.requests = Counter("servegate_requests", "Requests by outcome.",
                                ["tenant", "model", "backend", "status", "adapter"], registry=r)
        self.tokens = Counter("servegate_tokens", "Tokens by kind (prompt, completion, cached).",
                              ["tenant", "model", "kind", "adapter"], registry=r)
        self.spend = Counter("servegate_spend_usd", "Spend at the models' prices, in USD.", ["tenant", "model"],
                             registry=r)
        self.quota_rejections = Counter("servegate_quota_rejections", "Requests refused by a quota.",
                                        ["tenant", "limit"], registry=r)
        self.ttft = Histogram("servegate_ttft_seconds", "Time to first token, as the gateway sees it.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("servegate_itl_seconds", "Time between two streamed chunks.",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("servegate_e2e_seconds", "Request latency, start to last byte.",
                             ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram("servegate_overhead_seconds",
                                  "Gateway time before the backend is called (auth, limits, quota).",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        self.adapter_loads = Histogram("servegate_adapter_load_seconds",
                                       "Time a backend took to load a LoRA adapter a request needed.", ["backend"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.canary_actions = Counter("servegate_canary_actions", "Canaries the guard rolled back or promoted.",
                                      ["alias", "action"], registry=r)
        self.in_flight = Gauge("servegate_in_flight", "Requests in flight.", ["backend"], registry=r)
        self.queued = Gauge("servegate_queue_depth", "Requests waiting for a backend slot.", ["backend"], registry=r)
        self.quarantined = Gauge("servegate_usage_quarantined_records", "Usage records the database refused, "
                                 "kept aside in the spool directory's quarantine.jsonl since this process started.",
                                 registry=r)
        # What the HorizontalPodAutoscaler scales on (deploy/kubernetes/base/hpa.yaml).
        self.saturation = Gauge("servegate_saturation", "The fullest backend's requests in flight and queued "
                                "over this replica's slots for it (1: every slot busy).", registry=r)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; `extra={...}` fields are merged in."""

    RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in self.RESERVED})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
