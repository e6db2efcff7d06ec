"""The gateway's tables (SQLModel). Alembic migrations in `migrations/` create them."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Annotated, Any

from pydantic import PlainSerializer
from sqlalchemy import JSON, BigInteger, Column, LargeBinary, TypeDecorator, UniqueConstraint
from sqlmodel import Field, SQLModel

from backends.base import NANO_USD_PER_USD


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime | None) -> datetime | None:
    """Times without a zone (query parameters, the CLI) are taken as UTC."""
    return moment.replace(tzinfo=UTC) if moment is not None and moment.tzinfo is None else moment


def in_utc(moment: datetime) -> datetime:
    """A time from outside moved to UTC (taken as UTC without a zone); one that lies outside the years
    1 to 9999 once in UTC (0001-01-01T00:00+00:01, 9999-12-31T23:59-14:00) is refused by ValueError."""
    try:
        return as_utc(moment).astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{moment.isoformat()} lies outside the years 1 to 9999 in UTC") from None


MAX_LIMIT = 2**53  # fits the databases' 64-bit integers and JSON numbers
MAX_USD = Decimal(9_000_000_000)  # in nano-dollars, within a 64-bit integer


class Usd(TypeDecorator):
    """Dollars in the API, whole nano-dollars in the database: exact on SQLite too."""

    impl = BigInteger
    cache_ok = True

    def process_bind_param(self, value: Decimal | None, dialect) -> int | None:
        return nano_usd(value)

    def process_result_value(self, value: int | None, dialect) -> Decimal | None:
        return None if value is None else usd(value)


def usd(nano_usd: int) -> Decimal:
    return Decimal(nano_usd).scaleb(-9).normalize()


def dollars(nano_usd: int) -> str:
    """For people: "$5.00", "$1,234.50", and every digit where cents do not say it all: "$0.000000001"."""
    return f"${usd(nano_usd):,.2f}" if nano_usd % 10**7 == 0 else f"${usd(nano_usd):,f}"


# In JSON, a plain decimal string: "300", "0.000000001" (never "3E+2", "1E-9").
Dollars = Annotated[Decimal, PlainSerializer(lambda value: format(value, "f"), return_type=str, when_used="json")]


def nano_usd(dollars: Decimal | None) -> int | None:
    return None if dollars is None else int(dollars * NANO_USD_PER_USD)


class UsageLimits(SQLModel):
    """Requests and tokens per minute and spend: the limits every scope may carry, an adapter too."""

    rpm: int | None = Field(default=None, ge=1, le=MAX_LIMIT, description="Requests per minute.")
    tpm: int | None = Field(default=None, ge=1, le=MAX_LIMIT, description="Tokens (prompt + completion) per minute.")
    daily_budget_usd: Dollars | None = Field(default=None, gt=0, le=MAX_USD, decimal_places=9, sa_type=Usd,
                                             description="Spend per UTC day, in USD (prices: SERVEGATE_PRICES).")
    monthly_budget_usd: Dollars | None = Field(default=None, gt=0, le=MAX_USD, decimal_places=9, sa_type=Usd,
                                               description="Spend per UTC calendar month, in USD.")


class Limits(UsageLimits):
    """Quota limits; None means unlimited. Tenants carry them, and keys may narrow them."""

    tokens_per_day: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    max_concurrency: int | None = Field(default=None, ge=1, le=MAX_LIMIT, description="Requests in flight at once.")
    max_tokens_per_request: int | None = Field(default=None, ge=1, le=MAX_LIMIT, description="Cap on max_tokens.")


class Tenant(Limits, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=64)
    tier: str = Field(default="standard", max_length=32)
    # Model aliases this tenant may call; empty means every served model.
    models: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    disabled: bool = False
    created_at: datetime = Field(default_factory=utcnow)


class ApiKey(Limits, table=True):
    __tablename__ = "api_key"

    id: int | None = Field(default=None, primary_key=True)
    prefix: str = Field(index=True, unique=True, max_length=16)  # public, shown in listings and usage
    key_hash: str = Field(max_length=64)  # sha256 hex of the whole key; the key itself is never stored
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    name: str = Field(default="", max_length=128)
    scopes: str = Field(default="inference", max_length=64)  # comma separated: inference, admin
    created_at: datetime = Field(default_factory=utcnow)
    expires_at: datetime | None = None
    revoked_at: datetime | None = None


class BackendRecord(SQLModel, table=True):
    __tablename__ = "backend"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=64)
    kind: str = Field(max_length=32)  # builtin, vllm, sglang, tgi, llamacpp, litellm...
    url: str | None = None
    model: str | None = None
    options: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class Route(SQLModel, table=True):
    """A model alias -> backend targets. Versions are immutable; one is active (status)."""

    __table_args__ = (UniqueConstraint("alias", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    alias: str = Field(index=True, max_length=128)
    version: int = 1
    status: str = Field(default="active", max_length=16)  # active | canary | retired
    targets: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = Field(default_factory=utcnow)


class AdapterRecord(UsageLimits, table=True):
    """A LoRA adapter clients call by its name as a model: served on its base's backends, by the
    tenants it names and its owner's (an operator's adapter has no owner); its limits bind every use
    of it, whoever calls."""

    __tablename__ = "adapter"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True, max_length=128)
    base: str = Field(max_length=128)  # the served model or route alias it applies to
    path: str = Field(max_length=1024)  # where it was registered from
    # The copy of its files as checked at registration, which backends read, and their SHA-256; None
    # for an operator's path that only its runtime reads (a hub id).
    stored_path: str | None = Field(default=None, max_length=1024)
    digest: str | None = Field(default=None, max_length=64)
    owner: str | None = Field(default=None, max_length=64)  # a tenant's name; None: the operator's
    tenants: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # besides the owner
    created_at: datetime = Field(default_factory=utcnow)


class UsageRecord(SQLModel, table=True):
    __tablename__ = "usage"

    request_id: str = Field(primary_key=True, max_length=64)  # writes are idempotent on it
    tenant: str = Field(index=True, max_length=64)
    key_prefix: str | None = Field(default=None, max_length=16)
    model: str = Field(max_length=128)
    backend: str = Field(max_length=64)
    adapter: str | None = Field(default=None, max_length=128)  # the LoRA adapter applied; None: the base model
    route: str = Field(default="", max_length=128)
    api: str = Field(default="openai", max_length=16)  # openai | tgi
    stream: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_nano_usd: int = Field(default=0, sa_type=BigInteger)  # at the model's price when it ran
    ttft_ms: float | None = None
    latency_ms: float = 0.0
    status: str = Field(max_length=16)  # ok | error | cancelled
    error_type: str | None = Field(default=None, max_length=64)
    started_at: datetime = Field(index=True)
    finished_at: datetime


class ShadowResult(SQLModel, table=True):
    """A mirrored request: the candidate's answer beside the primary's (the client saw only the
    primary's)."""

    __tablename__ = "shadow_result"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, index=True)
    alias: str = Field(index=True, max_length=128)
    version: int
    request_id: str = Field(max_length=64)
    primary_backend: str = Field(max_length=64)
    shadow_backend: str = Field(max_length=64)
    greedy: bool
    primary_ttft_ms: float | None = None
    shadow_ttft_ms: float | None = None
    primary_latency_ms: float
    shadow_latency_ms: float
    primary_tokens: int
    shadow_tokens: int
    shadow_error: str | None = Field(default=None, max_length=64)
    exact_match: bool
    similarity: float  # token-level (whitespace tokens), 0-1


class AuditLog(SQLModel, table=True):
    __tablename__ = "audit_log"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, index=True)
    actor: str = Field(max_length=128)  # key prefix, or "cli:<user>"
    action: str = Field(max_length=64)  # tenant.create, key.revoke...
    target: str = Field(max_length=128)
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


class StoredResponse(SQLModel, table=True):
    """A `/v1/responses` answer kept (`store`) for `GET /v1/responses/{id}` and for a response that
    follows it (`previous_response_id`): readable by its tenant only, until it expires."""

    __tablename__ = "stored_response"

    id: str = Field(primary_key=True, max_length=64)  # resp_...
    tenant: str = Field(index=True, max_length=64)
    key_prefix: str | None = Field(default=None, max_length=16)
    model: str = Field(max_length=128)
    # The conversation as chat messages, this response's output included: where a follower continues.
    messages: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    # The input items as the client sent them (this turn's only), for `/v1/responses/{id}/input_items`.
    input_items: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    body: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))  # the Response
    created_at: datetime = Field(default_factory=utcnow, index=True)
    expires_at: datetime = Field(index=True)


class StoredFile(SQLModel, table=True):
    """A file of `/v1/files`: a batch's input (JSONL, checked line by line on upload), or a batch's
    output or errors. `gateway/files.py` keeps its bytes: in `file_chunk` rows, or in `directory`."""

    __tablename__ = "file"

    id: str = Field(primary_key=True, max_length=64)  # file-...
    tenant: str = Field(index=True, max_length=64)
    purpose: str = Field(max_length=32)  # batch | batch_output | batch_errors
    filename: str = Field(max_length=255)
    size: int = 0  # bytes
    lines: int = 0
    # "writing" while its bytes are written (counted against the quota, shown to no one), then "processed".
    status: str = Field(default="processed", max_length=16)
    directory: str | None = Field(default=None, max_length=1024)  # the directory holding its bytes; None: the database
    created_at: datetime = Field(default_factory=utcnow, index=True)
    expires_at: datetime | None = Field(default=None, index=True)


class FileChunk(SQLModel, table=True):
    """A slice (about 1 MiB) of a file kept in the database, in order of `seq`."""

    __tablename__ = "file_chunk"

    file_id: str = Field(primary_key=True, max_length=64)
    seq: int = Field(primary_key=True)
    data: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class BatchRecord(SQLModel, table=True):
    """A `/v1/batches` job: its input file's lines run in the background, at a lower priority than
    interactive requests. One replica at a time runs it: the one whose lease (`runner`,
    `lease_until`) is current."""

    __tablename__ = "batch"

    id: str = Field(primary_key=True, max_length=64)  # batch_...
    tenant: str = Field(index=True, max_length=64)
    key_prefix: str | None = Field(default=None, max_length=16)  # whose key created it: lines run as it
    endpoint: str = Field(max_length=64)
    input_file_id: str = Field(max_length=64)
    completion_window: str = Field(default="24h", max_length=16)
    # validating | in_progress | finalizing | completed | failed | expired | cancelling | cancelled
    status: str = Field(default="in_progress", index=True, max_length=16)
    total: int = 0
    completed: int = 0
    failed: int = 0
    output_file_id: str | None = Field(default=None, max_length=64)
    error_file_id: str | None = Field(default=None, max_length=64)
    errors: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON))
    labels: dict[str, str] | None = Field(default=None, sa_column=Column("metadata", JSON))  # OpenAI's metadata
    runner: str | None = Field(default=None, max_length=64)
    lease_until: datetime | None = None
    created_at: datetime = Field(default_factory=utcnow, index=True)
    expires_at: datetime
    in_progress_at: datetime | None = None
    finalizing_at: datetime | None = None
    completed_at: datetime | None = None
    failed_at: datetime | None = None
    expired_at: datetime | None = None
    cancelling_at: datetime | None = None
    cancelled_at: datetime | None = None


class BatchResult(SQLModel, table=True):
    """One line's answer, written once (its key refuses a second): a restart runs only the lines
    without one, and the output and error files are these rows in line order."""

    __tablename__ = "batch_result"

    batch_id: str = Field(primary_key=True, max_length=64)
    line: int = Field(primary_key=True)
    custom_id: str = Field(max_length=512)
    request_id: str = Field(max_length=64)
    status_code: int
    body: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    at: datetime = Field(default_factory=utcnow)
