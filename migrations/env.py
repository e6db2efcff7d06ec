"""Alembic environment: runs on the engine `gateway.db` hands over (or `sqlalchemy.url`)."""

from alembic import context
from sqlmodel import SQLModel, create_engine

import gateway.models  # noqa: F401  (registers the tables on SQLModel.metadata)

config = context.config
engine = config.attributes.get("engine") or create_engine(config.get_main_option("sqlalchemy.url"))

with engine.begin() as connection:
    context.configure(
        connection=connection, target_metadata=SQLModel.metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    )
    with context.begin_transaction():
        context.run_migrations()
