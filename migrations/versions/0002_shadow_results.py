"""shadow results: mirrored requests compared with the primary's answers

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('shadow_result',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('at', sqlmodel.sql.sqltypes.UTCDateTime(), nullable=False),
    sa.Column('alias', sqlmodel.sql.sqltypes.AutoString(length=128), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('request_id', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('primary_backend', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('shadow_backend', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=False),
    sa.Column('greedy', sa.Boolean(), nullable=False),
    sa.Column('primary_ttft_ms', sa.Float(), nullable=True),
    sa.Column('shadow_ttft_ms', sa.Float(), nullable=True),
    sa.Column('primary_latency_ms', sa.Float(), nullable=False),
    sa.Column('shadow_latency_ms', sa.Float(), nullable=False),
    sa.Column('primary_tokens', sa.Integer(), nullable=False),
    sa.Column('shadow_tokens', sa.Integer(), nullable=False),
    sa.Column('shadow_error', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True),
    sa.Column('exact_match', sa.Boolean(), nullable=False),
    sa.Column('similarity', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('shadow_result', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_shadow_result_alias'), ['alias'], unique=False)
        batch_op.create_index(batch_op.f('ix_shadow_result_at'), ['at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('shadow_result', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_shadow_result_at'))
        batch_op.drop_index(batch_op.f('ix_shadow_result_alias'))
    op.drop_table('shadow_result')
