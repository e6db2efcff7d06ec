"""Alembic migrations of the gateway's database (`servegate db upgrade`)."""
