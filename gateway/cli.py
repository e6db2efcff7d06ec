"""The `servegate` command."""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
import yaml

from advisor.cli import advise_command
from advisor.measure.cli import BenchCommand, bench
from backends.launch import RUNTIMES as LAUNCHABLE

app = typer.Typer(help="servegate: LLM gateway, runtime advisor and TGI migration.", no_args_is_help=True)
db_app = typer.Typer(help="The gateway's database.", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants: who may call, which models, how much.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (stored only as hashes; a new key is shown once).", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
adapters_app = typer.Typer(help="LoRA adapters: called by name as models, served on their base's backends.",
                           no_args_is_help=True)
app.add_typer(adapters_app, name="adapters")
batches_app = typer.Typer(help="Batches (/v1/batches) of every tenant: list, inspect, cancel.", no_args_is_help=True)
app.add_typer(batches_app, name="batches")
responses_app = typer.Typer(help="Stored responses (/v1/responses) of every tenant: list (never their text), delete.",
                            no_args_is_help=True)
app.add_typer(responses_app, name="responses")
routes_app = typer.Typer(help="Routes: a model alias -> versioned targets, with canary and rollback.",
                         no_args_is_help=True)
app.add_typer(routes_app, name="routes")
migrate_app = typer.Typer(help="Move a deployment's traffic to another runtime.", no_args_is_help=True)
app.add_typer(migrate_app, name="migrate")


@app.callback()
def main() -> None:
    """servegate: LLM gateway, runtime advisor and TGI migration."""


def _stop_on_sigterm() -> None:
    """A supervisor's SIGTERM ends `launch` as Ctrl-C does, so the runtime is stopped too."""
    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


@contextmanager
def _session():
    """A session on the migrated database of `SERVEGATE_DATABASE_URL`; errors end the command."""
    from sqlmodel import Session

    from gateway.db import NotMigrated, check_migrated, make_engine
    from gateway.errors import GatewayError
    from gateway.settings import Settings

    engine = make_engine(Settings().database_url)
    try:
        check_migrated(engine)
        with Session(engine) as session:
            yield session
    except (NotMigrated, GatewayError) as exc:
        _fail(str(exc))


def _print(rows: list, as_json: bool, columns: list[str], whole: tuple[str, ...] = ()) -> None:
    """Rows as JSON or a table; the `whole` columns (ids to copy) are never cut short on a narrow terminal."""
    data = [r if isinstance(r, dict) else r.model_dump(mode="json") for r in rows]
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Column, Table

    cells = [["" if row[c] is None else str(row[c]) for c in columns] for row in data]
    table = Table(*(Column(c, no_wrap=True, min_width=max([len(c), *(len(r[i]) for r in cells)])) if c in whole
                    else c for i, c in enumerate(columns)))
    for row in cells:
        table.add_row(*row)
    Console().print(table)


def engine_options(command):
    """`command` with one option per `EngineConfig` field (its type, default and help), which it
    receives gathered and checked as `engine: EngineConfig | ValueError`."""
    import dataclasses
    import functools
    import inspect
    import typing

    from backends.builtin.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    fields = dataclasses.fields(EngineConfig)
    defaults = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default for f in fields}
    options = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=defaults[f.name], annotation=Annotated[
        hints[f.name], typer.Option(*filter(None, [f.metadata["flags"]]), help=f.metadata["help"],
                                    rich_help_panel="Built-in engine")]) for f in fields]
    own = [p for name, p in inspect.signature(command).parameters.items() if name != "engine"]

    @functools.wraps(command)
    def with_engine(**given):
        try:
            engine = EngineConfig(**{f.name: given.pop(f.name) for f in fields})
        except ValueError as exc:
            engine = exc
        return command(engine=engine, **given)

    with_engine.__signature__ = inspect.Signature(own + options)
    return with_engine


@app.command()
@engine_options
def serve(
    engine,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
    config: Annotated[Path | None, typer.Option(
        help="servegate.yaml declaring the backends (replaces the built-in engine options).")] = None,
) -> None:
    """Serve the OpenAI- and TGI-compatible APIs in front of the built-in engine, or of the
    backends a servegate.yaml declares.

    Settings come from SERVEGATE_* variables (database, Redis, JWT, limits; see docs). A new
    SQLite database is created at once; any other must be migrated with `servegate db upgrade`.
    On a database without keys, a `default` tenant and an admin key are created and the key is
    printed once (or taken from SERVEGATE_ADMIN_KEY)."""
    import uvicorn
    from sqlmodel import Session

    from gateway.app import create_app
    from gateway.config import load_backends
    from gateway.db import NotMigrated, check_migrated, is_new_sqlite, make_engine, upgrade
    from gateway.operations.telemetry import configure_logging
    from gateway.settings import Settings
    from gateway.tenancy.tenants import bootstrap

    if isinstance(engine, ValueError):  # before anything loads
        _fail(str(engine))
    settings = Settings()
    new = is_new_sqlite(settings.database_url)
    db = make_engine(settings.database_url)
    if new:
        upgrade(db)
    try:
        check_migrated(db)
    except NotMigrated as exc:
        _fail(str(exc))
    if config is not None:
        try:
            backends = load_backends(config)
        except (OSError, ValueError) as exc:
            _fail(str(exc))
    else:
        from backends.builtin import BuiltinBackend
        from backends.builtin.worker.loader import check_servable

        try:
            check_servable(engine.model or None)
        except (OSError, ValueError) as exc:
            _fail(str(exc))
        backend = BuiltinBackend(engine)
        backends = {backend.model_id: backend}
    configure_logging(log_level)
    with Session(db) as session:
        key = bootstrap(session, settings.admin_key)
    if key and not settings.admin_key:
        typer.echo(f"Created tenant `default` and an operator key (shown once, store it now):\n{key}", err=True)
    # uvicorn's access log is off: every inference request gets its own JSON line with richer fields.
    app = create_app(backends, settings, db, when_unservable=lambda: setattr(server, "should_exit", True),
                     freeze_gc=True)  # this process is the server's alone
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None,
                                           access_log=False))
    server.run()
    if len(app.state.gateway.failed_to_start) == len(backends):  # nothing was left to serve
        _fail("; ".join(app.state.gateway.failed_to_start.values()))


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="Target revision.")] = "head") -> None:
    """Run the migrations (creates the database schema on first use)."""
    from gateway.db import make_engine, revisions, upgrade
    from gateway.settings import Settings

    engine = make_engine(Settings().database_url)
    upgrade(engine, revision)
    typer.echo(f"database at revision {revisions(engine)[0]}")


@db_app.command("current")
def db_current() -> None:
    """The database's revision and the code's."""
    from gateway.db import make_engine, revisions
    from gateway.settings import Settings

    current, head = revisions(make_engine(Settings().database_url))
    typer.echo(f"database: {current or 'none'}, code: {head}")


LIMIT_OPTIONS = ("rpm", "tpm", "tokens_per_day", "max_concurrency", "max_tokens_per_request", "daily_budget_usd",
                 "monthly_budget_usd")


@tenants_app.command("create")
def tenants_create(
    name: str,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute.")] = None,
    tokens_per_day: Annotated[int | None, typer.Option(help="Tokens per day.")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="Requests in flight at once.")] = None,
    max_tokens_per_request: Annotated[int | None, typer.Option(help="Cap on max_tokens.")] = None,
    daily_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC day, USD.")] = None,
    monthly_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC month, USD.")] = None,
    models: Annotated[str, typer.Option(help="Models it may use, comma separated (default: all).")] = "",
    tier: Annotated[str, typer.Option(help="Tier, for routing rules.")] = "standard",
) -> None:
    """Create a tenant."""
    from pydantic import ValidationError

    from gateway.tenancy.tenants import TenantIn, cli_actor, create_tenant

    with _session() as session:
        try:
            data = TenantIn(name=name, tier=tier, models=[m for m in models.split(",") if m], rpm=rpm, tpm=tpm,
                            tokens_per_day=tokens_per_day, max_concurrency=max_concurrency,
                            max_tokens_per_request=max_tokens_per_request, daily_budget_usd=daily_budget_usd,
                            monthly_budget_usd=monthly_budget_usd)
        except ValidationError as exc:
            _fail(exc.errors()[0]["msg"])
        tenant = create_tenant(session, cli_actor(), data)
    typer.echo(f"created tenant {tenant.name}")


@tenants_app.command("list")
def tenants_list(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List tenants and their limits."""
    from gateway.tenancy.tenants import list_tenants

    with _session() as session:
        _print(list_tenants(session), as_json, ["name", "tier", "models", "disabled", *LIMIT_OPTIONS])


@tenants_app.command("update")
def tenants_update(
    name: str,
    rpm: Annotated[int | None, typer.Option(help="Requests per minute (0 lifts the limit).")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute (0 lifts the limit).")] = None,
    tokens_per_day: Annotated[int | None, typer.Option(help="Tokens per day (0 lifts the limit).")] = None,
    max_concurrency: Annotated[int | None, typer.Option(help="Requests in flight (0 lifts the limit).")] = None,
    max_tokens_per_request: Annotated[int | None, typer.Option(help="Cap on max_tokens (0 lifts it).")] = None,
    daily_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC day, USD (0 lifts it).")] = None,
    monthly_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC month, USD (0 lifts it).")] = None,
    models: Annotated[str | None, typer.Option(help="Models it may use, comma separated ('' = all).")] = None,
    tier: Annotated[str | None, typer.Option()] = None,
    disable: Annotated[bool | None, typer.Option("--disable/--enable", help="Refuse or accept its keys.")] = None,
) -> None:
    """Change a tenant's limits, models, tier, or disable it."""
    from gateway.tenancy.tenants import TenantPatch, cli_actor, update_tenant

    given = {"rpm": rpm, "tpm": tpm, "tokens_per_day": tokens_per_day, "max_concurrency": max_concurrency,
             "max_tokens_per_request": max_tokens_per_request, "daily_budget_usd": daily_budget_usd,
             "monthly_budget_usd": monthly_budget_usd}
    changes = {k: (v or None) for k, v in given.items() if v is not None}
    if models is not None:
        changes["models"] = [m for m in models.split(",") if m]
    if tier is not None:
        changes["tier"] = tier
    if disable is not None:
        changes["disabled"] = disable
    with _session() as session:
        tenant = update_tenant(session, cli_actor(), name, TenantPatch(**changes))
    typer.echo(f"updated tenant {tenant.name}")


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    scope: Annotated[list[str], typer.Option(
        help="inference | admin (its own tenant) | operator (every tenant); repeatable.")] = ["inference"],  # noqa: B006
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    expires_in_days: Annotated[float | None, typer.Option(help="Expiry.")] = None,
    rpm: Annotated[int | None, typer.Option(help="This key's own requests per minute.")] = None,
    tpm: Annotated[int | None, typer.Option(help="This key's own tokens per minute.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the key record as JSON.")] = False,
) -> None:
    """Create a key; the key is printed alone on the last line, once."""
    from pydantic import ValidationError

    from gateway.tenancy.tenants import KeyIn, cli_actor, create_key

    with _session() as session:
        try:
            data = KeyIn(tenant=tenant, scopes=scope, name=name, expires_in_days=expires_in_days, rpm=rpm, tpm=tpm)
        except ValidationError as exc:
            _fail(f"{'.'.join(map(str, exc.errors()[0]['loc']))}: {exc.errors()[0]['msg']}")
        created = create_key(session, cli_actor(), data)
    if as_json:
        typer.echo(created.model_dump_json(indent=2))
        return
    typer.echo(f"created key {created.prefix} for tenant {created.tenant} (scopes: {', '.join(created.scopes)})")
    typer.echo(created.key)


@keys_app.command("list")
def keys_list(tenant: Annotated[str | None, typer.Option()] = None,
              as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List keys (prefixes only: keys are never stored)."""
    from gateway.tenancy.tenants import list_keys

    with _session() as session:
        _print(list_keys(session, tenant), as_json,
               ["prefix", "tenant", "name", "scopes", "created_at", "expires_at", "revoked_at"])


@keys_app.command("revoke")
def keys_revoke(prefix: str) -> None:
    """Revoke a key; every replica refuses it within the refresh interval."""
    from gateway.tenancy.tenants import cli_actor, revoke_key

    with _session() as session:
        key = revoke_key(session, cli_actor(), prefix)
    typer.echo(f"revoked key {key.prefix} of tenant {key.tenant}")


@keys_app.command("rotate")
def keys_rotate(prefix: str) -> None:
    """Replace a key by a new one with the same tenant, scopes and limits; prints the new key."""
    from gateway.tenancy.tenants import cli_actor, rotate_key

    with _session() as session:
        created = rotate_key(session, cli_actor(), prefix)
    typer.echo(f"revoked key {prefix}; created key {created.prefix} for tenant {created.tenant}")
    typer.echo(created.key)


@adapters_app.command("add")
def adapters_add(
    name: Annotated[str, typer.Argument(help="The model name clients send for it.")],
    base: Annotated[str, typer.Option(help="The served model or route alias it applies to.")],
    path: Annotated[str, typer.Option(help="Where its backends read it: a directory, a file or a hub id.")],
    owner: Annotated[str | None, typer.Option(help="Its tenant (default: the operator's own).")] = None,
    tenants: Annotated[str, typer.Option(help="Tenants that may use it besides its owner, comma separated.")] = "",
    rpm: Annotated[int | None, typer.Option(help="Requests per minute, all its users together.")] = None,
    tpm: Annotated[int | None, typer.Option(help="Tokens per minute, all its users together.")] = None,
    daily_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC day, USD.")] = None,
    monthly_budget_usd: Annotated[float | None, typer.Option(help="Spend per UTC month, USD.")] = None,
) -> None:
    """Register a LoRA adapter; every replica serves it within the refresh interval."""
    from pydantic import ValidationError

    from gateway.settings import Settings
    from gateway.tenancy.adapters import AdapterIn, AdapterStore, create_adapter
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        try:
            data = AdapterIn(name=name, base=base, path=path, owner=owner, tenants=[t for t in tenants.split(",") if t],
                             rpm=rpm, tpm=tpm, daily_budget_usd=daily_budget_usd, monthly_budget_usd=monthly_budget_usd)
        except ValidationError as exc:
            _fail(f"{'.'.join(map(str, exc.errors()[0]['loc']))}: {exc.errors()[0]['msg']}")
        adapter = create_adapter(session, cli_actor(), data, AdapterStore.of(Settings()))
    typer.echo(f"added adapter {adapter.name} on {adapter.base}")


@adapters_app.command("list")
def adapters_list(owner: Annotated[str | None, typer.Option(help="Only this tenant's.")] = None,
                  as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List adapters, their bases, owners, tenants and limits."""
    from gateway.tenancy.adapters import list_adapters

    with _session() as session:
        _print(list_adapters(session, owner), as_json,
               ["name", "base", "path", "owner", "tenants", "rpm", "tpm", "daily_budget_usd", "monthly_budget_usd"])


@adapters_app.command("remove")
def adapters_remove(name: str) -> None:
    """Remove an adapter; requests stop finding it within the refresh interval."""
    from gateway.tenancy.adapters import delete_adapter
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        adapter = delete_adapter(session, cli_actor(), name)
    typer.echo(f"removed adapter {adapter.name}")


def _when(unix: int | None) -> str | None:
    """Unix seconds (as the batch and response objects give times) as a time in UTC, to the second."""
    from datetime import UTC, datetime

    return None if unix is None else datetime.fromtimestamp(unix, UTC).isoformat(sep=" ", timespec="seconds")[:19]


def _batch_row(batch: dict) -> dict:
    counts = batch["request_counts"]
    progress = f"{counts['completed'] + counts['failed']}/{counts['total']}"
    return {**batch, "progress": progress + (f", {counts['failed']} failed" if counts["failed"] else ""),
            **{k: _when(batch[k]) for k in ("created_at", "finished_at")}}


@batches_app.command("list")
def batches_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's.")] = None,
    status: Annotated[str | None, typer.Option(help="Only those in this status (in_progress, cancelling, "
                                                    "completed, failed, expired, cancelled...).")] = None,
    limit: Annotated[int, typer.Option(help="Batches to list, newest first.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List batches, newest first: tenant, key, endpoint, status, progress (lines done/total) and times (UTC)."""
    import typing

    from gateway.api.admin_batches import BatchStatus, list_batches

    if status is not None and status not in typing.get_args(BatchStatus):
        _fail(f"--status {status!r}: one of {', '.join(typing.get_args(BatchStatus))}")
    with _session() as session:
        batches = list_batches(session, tenant, status, limit)
    _print(batches if as_json else [_batch_row(b) for b in batches], as_json,
           ["id", "tenant", "key_prefix", "endpoint", "status", "progress", "created_at", "finished_at"],
           whole=("id",))


@batches_app.command("show")
def batches_show(batch_id: Annotated[str, typer.Argument(metavar="ID")],
                 as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One batch: its status, counts, times, files, errors and the replica running it."""
    from gateway.api.admin_batches import get_batch

    with _session() as session:
        batch = get_batch(session, batch_id, None)
    if as_json:
        typer.echo(json.dumps(batch, indent=2))
        return
    counts = batch["request_counts"]
    fields = {"id": batch["id"], "tenant": batch["tenant"], "key_prefix": batch["key_prefix"],
              "endpoint": batch["endpoint"], "status": batch["status"],
              "requests": f"{counts['completed']} completed, {counts['failed']} failed, {counts['total']} in all",
              **{f"{moment}_at": _when(batch[f"{moment}_at"]) for moment in (
                  "created", "in_progress", "cancelling", "finished", "expires")},
              **{k: batch[k] for k in ("input_file_id", "output_file_id", "error_file_id", "runner")},
              "lease_until": _when(batch["lease_until"]), "metadata": batch["metadata"],
              "errors": "; ".join(e.get("message", "") for e in (batch["errors"] or {}).get("data", [])) or None}
    _print([{"field": k, "value": v} for k, v in fields.items()], False, ["field", "value"])


@batches_app.command("cancel")
def batches_cancel(batch_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Cancel a batch: it takes no more lines and ends `cancelled` once those under way finish."""
    from backends.base import InvalidRequest
    from gateway.api.admin_batches import cancel_batch
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        try:
            batch = cancel_batch(session, cli_actor(), batch_id, None)
        except InvalidRequest as exc:
            _fail(str(exc))
    typer.echo(f"batch {batch['id']} of tenant {batch['tenant']} is {batch['status']}")


@responses_app.command("list")
def responses_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's.")] = None,
    limit: Annotated[int, typer.Option(help="Responses to list, newest first.", min=1)] = 100,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List stored responses, newest first: tenant, key, model, status, tokens and times (never their text)."""
    from gateway.api.admin_batches import list_responses

    with _session() as session:
        responses = list_responses(session, tenant, limit)
    if not as_json:
        responses = [{**r, "input_tokens": (r["usage"] or {}).get("input_tokens"),
                      "output_tokens": (r["usage"] or {}).get("output_tokens"),
                      **{k: _when(r[k]) for k in ("created_at", "expires_at")}} for r in responses]
    _print(responses, as_json, ["id", "tenant", "key_prefix", "model", "status", "input_tokens", "output_tokens",
                                "created_at", "expires_at"], whole=("id",))


@responses_app.command("delete")
def responses_delete(response_id: Annotated[str, typer.Argument(metavar="ID")]) -> None:
    """Delete a stored response: it can no longer be read or continued."""
    from gateway.api.admin_batches import delete_response
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        deleted = delete_response(session, cli_actor(), response_id, None)
    typer.echo(f"deleted response {deleted['id']} of tenant {deleted['tenant']}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    runtime: Annotated[str, typer.Argument(help=" | ".join(LAUNCHABLE))],
    model: Annotated[str, typer.Option(help="Model id or path, as the runtime takes it.")],
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    context_length: Annotated[int | None, typer.Option(help="Prompt + output tokens per request.")] = None,
    tensor_parallel: Annotated[int, typer.Option("--tp", help="Tensor-parallel GPUs.")] = 1,
    expert_parallel: Annotated[bool, typer.Option("--expert-parallel",
                                                  help="Split a MoE model's experts across the --tp devices.")] = False,
    kv_cache_dtype: Annotated[str | None, typer.Option(help="fp8_e4m3 | fp8_e5m2 | q8_0 | q4_0 | ...")] = None,
    max_running_requests: Annotated[int | None, typer.Option(help="Requests in the running batch.")] = None,
    prefix_caching: Annotated[bool | None, typer.Option("--prefix-caching/--no-prefix-caching")] = None,
    pipeline_parallel: Annotated[int, typer.Option("--pp", help="Pipeline-parallel stages.", min=1)] = 1,
    data_parallel: Annotated[int, typer.Option("--dp", help="Engine replicas the runtime balances.", min=1)] = 1,
    kv_tokens: Annotated[int | None, typer.Option(help="llama-server: one KV pool of this many tokens for all "
                                                       "slots.", min=1)] = None,
    lora: Annotated[list[str] | None, typer.Option(help="NAME=PATH of a LoRA adapter to serve; repeatable.")] = None,
    max_loras: Annotated[int | None, typer.Option(help="Adapters one batch may mix.", min=1)] = None,
    max_lora_rank: Annotated[int | None, typer.Option(help="The largest adapter rank.", min=1)] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the command and exit.")] = False,
) -> None:
    """Start a runtime as a supervised subprocess from one normalized spec, wait until it is
    ready, and stop it cleanly on Ctrl-C. Arguments after `--` go to the runtime untouched."""
    from backends.launch import RUNTIMES, LaunchError, LaunchSpec, ServerNotReady, launched, lora_modules, shell_line

    if runtime not in RUNTIMES:
        _fail(f"unknown runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    try:
        spec = LaunchSpec(runtime=runtime, model=model, port=port, host=host, context_length=context_length,
                          tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                          kv_cache_dtype=kv_cache_dtype, max_running_requests=max_running_requests,
                          prefix_caching=prefix_caching, pipeline_parallel=pipeline_parallel,
                          data_parallel=data_parallel, kv_tokens=kv_tokens, lora_modules=lora_modules(lora or []),
                          max_loras=max_loras, max_lora_rank=max_lora_rank, extra_args=list(ctx.args))
        typer.echo(shell_line(spec))
    except LaunchError as exc:
        _fail(str(exc))
    if dry_run:
        return
    _stop_on_sigterm()
    try:
        with launched(spec) as url:
            typer.echo(f"{runtime} ready at {url}", err=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except ServerNotReady as exc:
        _fail(str(exc))


@app.command()
def usage(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant.")] = None,
    since: Annotated[str | None, typer.Option(help="ISO time (UTC if no zone).")] = None,
    until: Annotated[str | None, typer.Option(help="ISO time (UTC if no zone).")] = None,
    limit: Annotated[int, typer.Option(help="Records to list.")] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Usage totals and the latest records, from the database."""
    from datetime import datetime

    from gateway.tables import in_utc
    from gateway.tenancy.tenants import usage_report

    try:
        start, end = (in_utc(datetime.fromisoformat(t)) if t else None for t in (since, until))
    except ValueError as exc:
        _fail(f"bad time: {exc}")
    with _session() as session:
        report = usage_report(session, tenant, start, end, limit)
    if as_json:
        typer.echo(report.model_dump_json(indent=2))
        return
    t = report.totals
    typer.echo(f"{t.requests} requests, {t.prompt_tokens} prompt tokens ({t.cached_tokens} cached), "
               f"{t.completion_tokens} completion tokens, ${t.cost_usd:,.6f}")
    columns = ["started_at", "tenant", "key_prefix", "model", "adapter", "status", "prompt_tokens",
               "completion_tokens", "cost_nano_usd", "latency_ms"]
    _print(report.records, False, columns)


def _share(text: str) -> float:
    """'10%' or '0.1' -> 0.1"""
    try:
        share = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        _fail(f"--canary {text!r}: a share such as 10% or 0.1")
    if not 0 < share < 1:
        _fail(f"--canary {text!r}: a share strictly between 0% and 100%")
    return share


def _backend_names(config: Path) -> set[str]:
    from gateway.config import GatewayConfig

    return {b.name for b in GatewayConfig.model_validate(yaml.safe_load(config.read_text()) or {}).backends}


@routes_app.command("deploy")
def routes_deploy(
    alias: str,
    file: Annotated[Path, typer.Option("--file", "-f", help="The route version, as YAML.", exists=True)],
    canary: Annotated[str | None, typer.Option(help="Send this share of traffic to it, e.g. 10%.")] = None,
    config: Annotated[Path | None, typer.Option(help="servegate.yaml: check the targets exist.", exists=True)] = None,
) -> None:
    """Deploy a new version of a route: active at once, or as a canary beside the active one."""
    from pydantic import ValidationError

    from gateway.rollout.route_versions import RouteSpec, deploy
    from gateway.tenancy.tenants import cli_actor

    try:
        spec = RouteSpec.model_validate(yaml.safe_load(file.read_text()) or {})
    except (ValidationError, yaml.YAMLError) as exc:
        _fail(f"{file}: {exc}")
    known = _backend_names(config) if config else None
    with _session() as session:
        out = deploy(session, cli_actor(), alias, spec, _share(canary) if canary else None, known)
    typer.echo(f"{alias}: version {out.version} is {out.status}" + (f" with {out.share:.0%} of traffic"
                                                                     if out.share else ""))


@routes_app.command("promote")
def routes_promote(alias: str) -> None:
    """Make the canary the active version."""
    from gateway.rollout.route_versions import promote
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        out = promote(session, cli_actor(), alias)
    typer.echo(f"{alias}: version {out.version} is active")


@routes_app.command("rollback")
def routes_rollback(
    alias: str,
    to: Annotated[int | None, typer.Option(help="The version to make active (default: the one before).")] = None,
    reason: Annotated[str, typer.Option(help="Why, for the audit log.")] = "",
) -> None:
    """End the canary, or return to an earlier version; replicas follow within the refresh
    interval and requests already running finish where they are."""
    from gateway.rollout.route_versions import rollback
    from gateway.tenancy.tenants import cli_actor

    with _session() as session:
        out = rollback(session, cli_actor(), alias, to, reason)
    typer.echo(f"{alias}: version {out.version} is active")


@routes_app.command("history")
def routes_history(alias: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """A route's versions, newest first, and every change made to it."""
    from gateway.rollout.route_versions import history

    with _session() as session:
        data = history(session, alias)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    rows = [{"version": v["version"], "status": v["status"], "share": v["share"] or "",
             "targets": ", ".join(f"{t['backend']}:{t['weight']:g}" for t in v["spec"]["targets"]),
             "created_at": v["created_at"]} for v in data["versions"]]
    _print(rows, False, ["version", "status", "share", "targets", "created_at"])
    _print([{k: c[k] for k in ("at", "actor", "action", "target")} for c in data["changes"]], False,
           ["at", "actor", "action", "target"])


@routes_app.command("shadow-report")
def routes_shadow_report(alias: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Mirrored requests: each candidate's errors, latency and agreement with the primary."""
    from gateway.rollout.shadow import report

    with _session() as session:
        rows = report(session, alias)
    if not rows and not as_json:
        typer.echo(f"no shadow traffic recorded for {alias!r}")
        return
    _print(rows, as_json, ["version", "shadow_backend", "requests", "error_rate", "primary_ttft_p50_ms",
                           "shadow_ttft_p50_ms", "exact_match_rate", "mean_similarity"])


@migrate_app.command("tgi", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def migrate_tgi(
    ctx: typer.Context,
    alias: Annotated[str | None, typer.Option(help="The alias clients will use (default: from the model id).")] = None,
    tgi_url: Annotated[str, typer.Option(help="Where TGI serves now.")] = "http://127.0.0.1:3000",
    candidate: Annotated[str, typer.Option(help="vllm | sglang")] = "vllm",
    candidate_url: Annotated[str, typer.Option(help="Where the candidate will serve.")] = "http://127.0.0.1:8001",
    output_format: Annotated[str, typer.Option("--format", help="md | json")] = "md",
    output: Annotated[Path | None, typer.Option(help="Write plan, servegate.yaml and route files here.")] = None,
) -> None:
    """Plan the move off TGI: `servegate migrate tgi -- --model-id X --num-shard 2 ... PREFIX_CACHING=1`."""
    from gateway.rollout.tgi_migration import MigrationError, TGIDeployment, plan, to_markdown
    from policies.rollout import load_rollout

    if candidate not in ("vllm", "sglang"):
        _fail(f"--candidate {candidate!r}: vllm or sglang")
    if output_format not in ("md", "json"):
        _fail(f"--format {output_format!r}: md or json")
    try:
        deployment = TGIDeployment.parse(list(ctx.args))
        name = alias or deployment.flags["model-id"].rsplit("/", 1)[-1].lower()
        result = plan(deployment, name, tgi_url, candidate_url, candidate, load_rollout())
    except MigrationError as exc:
        _fail(str(exc))
    text = json.dumps(result, indent=2) if output_format == "json" else to_markdown(result)
    if output is None:
        typer.echo(text)
        return
    output.mkdir(parents=True, exist_ok=True)
    (output / f"plan.{output_format}").write_text(text)
    (output / "servegate.yaml").write_text(yaml.safe_dump(result["servegate_yaml"], sort_keys=False))
    for route, spec in result["routes"].items():
        (output / f"route-{route}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    typer.echo(f"plan written to {output}")


# `servegate bench` lives in the advisor: it is the advisor's measuring instrument too.
app.command(name="bench", cls=BenchCommand)(bench)
app.command(name="advise")(advise_command)
