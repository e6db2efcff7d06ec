"""Database engine, sessions and the migration check. The request path never touches it:
keys, tenants and routes are read from memory (`gateway/auth.py`), usage is written in batches."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url
from sqlmodel import create_engine

import migrations


class NotMigrated(RuntimeError):
    """The database is not at the code's schema revision."""


def make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")  # readers do not block the usage writer
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


def is_new_sqlite(url: str) -> bool:
    """A SQLite file that does not exist yet: `serve` may create it at the current revision."""
    parsed = make_url(url)
    return parsed.get_backend_name() == "sqlite" and bool(parsed.database) and \
        not Path(parsed.database).expanduser().exists()


def _alembic(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(migrations.__file__).parent))
    config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(_alembic(engine), revision)


def revisions(engine: Engine) -> tuple[str | None, str]:
    """(the database's revision, the code's head revision)."""
    head = ScriptDirectory.from_config(_alembic(engine)).get_current_head()
    with engine.connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    return current, head


def check_migrated(engine: Engine) -> None:
    current, head = revisions(engine)
    if current != head:
        state = "has no servegate schema" if current is None else f"is at revision {current}"
        raise NotMigrated(
            f"the database {engine.url.render_as_string(hide_password=True)} {state}, the code needs {head}: "
            "run `servegate db upgrade` first"
        )
