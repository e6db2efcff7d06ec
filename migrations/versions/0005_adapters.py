"""adapters: LoRA adapters registered as models, and the adapter each usage record applied

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06 12:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('adapter',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('base', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('path', sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=False),
    sa.Column('owner', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('tenants', sa.JSON(), nullable=False),
    sa.Column('rpm', sa.Integer(), nullable=True),
    sa.Column('tpm', sa.Integer(), nullable=True),
    sa.Column('daily_budget_usd', sa.BigInteger(), nullable=True),
    sa.Column('monthly_budget_usd', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('adapter', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapter_name'), ['name'], unique=True)
    with op.batch_alter_table('usage') as table:
        table.add_column(sa.Column('adapter', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage') as table:
        table.drop_column('adapter')
    with op.batch_alter_table('adapter', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_adapter_name'))
    op.drop_table('adapter')
