"""Gateway settings, from `SERVEGATE_*` environment variables (or a `.env` file)."""

from __future__ import annotations

import os
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backends.base import Price

BATCH_API = "batch"  # the `api` a batch's lines are billed under, at `Settings.batch_price`


def data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "servegate"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVEGATE_", env_file=".env", extra="ignore")

    # SQLite (WAL) serves one replica; PostgreSQL (postgresql+psycopg://...) serves several.
    database_url: str = f"sqlite:///{data_dir() / 'servegate.db'}"
    # Quotas shared by several replicas; without it they are held in process.
    redis_url: str | None = None
    # With Redis unreachable: "open" enforces every limit on each replica alone (each replica's
    # windows and budgets rebuilt from the ledger when Redis went away, so N replicas may together
    # spend up to N times what was left of a budget); "closed" refuses requests (503) until it is back.
    quota_redis_down: Literal["open", "closed"] = "open"
    # A concurrency slot in Redis is a lease its replica renews: a dead replica's slots free after this.
    quota_lease_s: float = 15.0
    # A tenant's administrator registers LoRA adapters only from under `<this>/<tenant>/` (a path
    # elsewhere, through `..` or a link included, is refused: runtimes read it with the gateway's
    # reach); unset, only operators register adapters.
    tenant_adapter_dir: Path | None = None
    # Registered adapters' files are copied here as they were checked (`<sha256>/`), and backends read
    # the copy (so a runtime on another host must see this directory at this path). Their size bound:
    adapter_store_dir: Path = data_dir() / "adapters"
    adapter_max_bytes: int = 2 * 1024**3
    # The first admin key, used only when the database holds no key yet.
    admin_key: str | None = None
    # Keys, tenants and routes are served from memory and re-read this often.
    refresh_s: float = 5.0
    # Routing: how often route targets' live load is read, and the seed of every routing choice
    # (unset: a fresh seed per process).
    load_poll_s: float = 1.0
    route_seed: int | None = None
    # The canary guard's thresholds (default: the shipped policies/rollout.yaml).
    rollout_policy: Path | None = None
    # Usage records are appended here before the response ends, then batched into the database.
    spool_dir: Path = data_dir() / "spool"
    usage_flush_s: float = 0.5
    # Open streams' usage is checkpointed this often: a process killed mid-stream loses at most this
    # much of each stream's billing. Spools of stopped processes are looked for this often.
    checkpoint_s: float = 1.0
    recover_s: float = 5.0
    # Log prompts and outputs (off: logs carry request ids, tenants and figures only).
    log_prompts: bool = False
    # Tenants share prefix-cache hits. Off, each tenant's prompts reuse only its own cached prefixes
    # (on the built-in engine and vLLM, through a cache salt per tenant): a hit's shorter time to the
    # first token, and its cached-token count, would tell one tenant what another sent.
    shared_prefix_cache: bool = False
    # Prices per model asked for (served model or route alias), in USD per million tokens, as JSON:
    # {"qwen2.5-7b": {"input": 0.2, "cached_input": 0.05, "output": 0.6}}. A model without one is
    # priced at its backend's list price (cloud providers: litellm's cost map), else free.
    prices: dict[str, Price] = {}
    # Budget alerts (80% and 100% of a daily or monthly budget) are logged, and POSTed here if set.
    budget_webhook_url: str | None = None
    # OpenTelemetry traces, sent over OTLP/HTTP to this collector (e.g. http://collector:4318/v1/traces;
    # the `otel` extra); unset: no traces, at no cost.
    otlp_endpoint: str | None = None

    # JWT bearer tokens, as an alternative to API keys: a static public key (PEM) or a JWKS URL.
    jwt_public_key: str | None = None
    jwt_jwks_url: str | None = None
    jwt_algorithms: list[str] = ["RS256", "ES256", "EdDSA"]
    # Required with JWT on: a token must name this audience and this issuer (a token minted for
    # another service of the same identity provider is refused).
    jwt_audience: str | None = None
    jwt_issuer: str | None = None
    jwt_tenant_claim: str = "tenant"
    jwt_scope_claim: str = "scope"
    # The scope value that makes a token an operator's (global administration); unset, no token is.
    jwt_operator_scope: str | None = None

    # Backpressure, per backend: requests in flight, then a bounded wait queue.
    max_in_flight: int = 64
    max_queued: int = 256
    queue_timeout_s: float = 30.0
    # A request's whole life, and the longest silence between two events of a stream.
    request_timeout_s: float = 600.0
    idle_timeout_s: float = 60.0
    # A route target failing this many times in a row is skipped for the cooldown, then probed.
    breaker_failures: int = 3
    breaker_cooldown_s: float = 10.0
    # The largest request body accepted (413 beyond it).
    max_body_bytes: int = 8 * 1024 * 1024
    # A body larger than this (or of undeclared size) is read only once its sender is known to have
    # quota left: its key and quotas are checked from the headers first.
    gate_body_bytes: int = 256 * 1024
    # `/metrics` answers loopback clients freely; others must send this token as a bearer.
    metrics_token: str | None = None

    # `/v1/responses` kept with `store` (the default) are readable, and continued, for this long.
    responses_retention_s: float = 30 * 86400
    # `/v1/files`: the largest upload, and a batch input's most lines (OpenAI's caps); uploads are
    # kept this long unless they ask otherwise (`expires_after`), batch outputs and errors this long.
    file_max_bytes: int = 200 * 1024 * 1024
    batch_max_lines: int = 50_000
    input_retention_s: Annotated[float, Field(gt=0)] = 30 * 86400
    output_retention_s: float = 30 * 86400
    # The bytes of the files a tenant keeps at once (uploads refused beyond it; outputs count too).
    file_quota_bytes: int = 2 * 1024**3
    # Files' bytes are kept in this directory (shared by every replica) instead of the database.
    file_store_dir: Path | None = None
    # `/v1/batches`: what a batch's tokens cost against the interactive price (0.5: half, OpenAI's
    # discount), the batches a tenant may have unfinished at once, and the lines one replica runs at
    # once, only while no interactive request waits for its backend.
    batch_price: Annotated[Decimal, Field(ge=0, le=1)] = Decimal("0.5")
    batch_active_per_tenant: int = 8
    batch_concurrency: int = 4

    # OpenAPI's interactive pages (/docs, /redoc) load their scripts from a CDN, on the origin where the
    # console keeps its key: off unless asked for. The schema itself, /openapi.json, is always served.
    api_docs: bool = False

    @model_validator(mode="after")
    def _jwt_names_its_audience_and_issuer(self) -> Settings:
        if self.jwt_enabled and not (self.jwt_audience and self.jwt_issuer):
            raise ValueError("JWT bearer tokens are on (SERVEGATE_JWT_PUBLIC_KEY or SERVEGATE_JWT_JWKS_URL): set "
                             "SERVEGATE_JWT_AUDIENCE and SERVEGATE_JWT_ISSUER to the values tokens for this gateway "
                             "carry")
        return self

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, prices: dict[str, Price]) -> dict[str, Price]:
        for model, price in prices.items():
            if any(v is not None and v < 0 for v in (price.input, price.output, price.cached_input)):
                raise ValueError(f"the price of {model!r} is negative")
        return prices

    def price(self, model: str, listed: Price | None, api: str) -> Price | None:
        """What a model's tokens cost: its configured price, else its backend's list price; a batch's
        lines (api "batch") at `batch_price` of it."""
        price = self.prices.get(model) or listed
        if price is None or api != BATCH_API:
            return price
        factor = self.batch_price
        return Price(price.input * factor, price.output * factor,
                     None if price.cached_input is None else price.cached_input * factor)

    @property
    def jwt_enabled(self) -> bool:
        return bool(self.jwt_public_key or self.jwt_jwks_url)

