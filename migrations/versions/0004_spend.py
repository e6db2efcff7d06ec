"""spend: each request's cost in the ledger, daily and monthly budgets on tenants and keys

Money is stored in whole nano-dollars (64-bit integers), exact on every database.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 19:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BUDGETS = ("daily_budget_usd", "monthly_budget_usd")


def upgrade() -> None:
    with op.batch_alter_table("usage") as table:
        table.add_column(sa.Column("cost_nano_usd", sa.BigInteger(), nullable=False, server_default="0"))
    for name in ("tenant", "api_key"):
        with op.batch_alter_table(name) as table:
            for budget in BUDGETS:
                table.add_column(sa.Column(budget, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for name in ("tenant", "api_key"):
        with op.batch_alter_table(name) as table:
            for budget in BUDGETS:
                table.drop_column(budget)
    with op.batch_alter_table("usage") as table:
        table.drop_column("cost_nano_usd")
