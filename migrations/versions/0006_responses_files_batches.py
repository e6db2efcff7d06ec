"""responses, files and batches: stored Responses, uploaded and produced files, batch jobs and their lines' results

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-06 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

String = sqlmodel.sql.sqltypes.AutoString
Moment = sqlmodel.sql.sqltypes.UTCDateTime


def upgrade() -> None:
    op.create_table('stored_response',
    sa.Column('id', String(length=64), nullable=False),
    sa.Column('tenant', String(length=64), nullable=False),
    sa.Column('key_prefix', String(length=16), nullable=True),
    sa.Column('model', String(length=128), nullable=False),
    sa.Column('messages', sa.JSON(), nullable=False),
    sa.Column('input_items', sa.JSON(), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.Column('created_at', Moment(), nullable=False),
    sa.Column('expires_at', Moment(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_stored_response_tenant', 'stored_response', ['tenant'])
    op.create_index('ix_stored_response_created_at', 'stored_response', ['created_at'])
    op.create_index('ix_stored_response_expires_at', 'stored_response', ['expires_at'])
    op.create_table('file',
    sa.Column('id', String(length=64), nullable=False),
    sa.Column('tenant', String(length=64), nullable=False),
    sa.Column('purpose', String(length=32), nullable=False),
    sa.Column('filename', String(length=255), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('lines', sa.Integer(), nullable=False),
    sa.Column('content', sa.LargeBinary(), nullable=False),
    sa.Column('created_at', Moment(), nullable=False),
    sa.Column('expires_at', Moment(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_file_tenant', 'file', ['tenant'])
    op.create_index('ix_file_created_at', 'file', ['created_at'])
    op.create_table('batch',
    sa.Column('id', String(length=64), nullable=False),
    sa.Column('tenant', String(length=64), nullable=False),
    sa.Column('key_prefix', String(length=16), nullable=True),
    sa.Column('endpoint', String(length=64), nullable=False),
    sa.Column('input_file_id', String(length=64), nullable=False),
    sa.Column('completion_window', String(length=16), nullable=False),
    sa.Column('status', String(length=16), nullable=False),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('completed', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('output_file_id', String(length=64), nullable=True),
    sa.Column('error_file_id', String(length=64), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('runner', String(length=64), nullable=True),
    sa.Column('lease_until', Moment(), nullable=True),
    sa.Column('created_at', Moment(), nullable=False),
    sa.Column('expires_at', Moment(), nullable=False),
    *(sa.Column(f'{moment}_at', Moment(), nullable=True) for moment in (
        'in_progress', 'finalizing', 'completed', 'failed', 'expired', 'cancelling', 'cancelled')),
    sa.PrimaryKeyConstraint('id')
    )
    op.create_index('ix_batch_tenant', 'batch', ['tenant'])
    op.create_index('ix_batch_status', 'batch', ['status'])
    op.create_index('ix_batch_created_at', 'batch', ['created_at'])
    op.create_table('batch_result',
    sa.Column('batch_id', String(length=64), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', String(length=512), nullable=False),
    sa.Column('request_id', String(length=64), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=False),
    sa.Column('body', sa.JSON(), nullable=False),
    sa.Column('at', Moment(), nullable=False),
    sa.PrimaryKeyConstraint('batch_id', 'line')
    )


def downgrade() -> None:
    op.drop_table('batch_result')
    op.drop_table('batch')
    op.drop_table('file')
    op.drop_table('stored_response')
