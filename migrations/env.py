"""Alembic environment: runs on the engine `gateway.db` hands over (or `sqlalchemy.url`)."""

from alembic import context
from sqlalchemy import text
from sqlmodel import SQLModel, create_engine

import gateway.tables  # noqa: F401  (registers the tables on SQLModel.metadata)

config = context.config
engine = config.attributes.get("engine") or create_engine(config.get_main_option("sqlalchemy.url"))

MIGRATION_LOCK = 0x5E67A7E  # a PostgreSQL advisory lock id of servegate's own

with engine.begin() as connection:
    if connection.dialect.name == "postgresql":  # replicas that start together migrate one at a time
        connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK})
    context.configure(
        connection=connection, target_metadata=SQLModel.metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()
