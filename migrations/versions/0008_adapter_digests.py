"""adapter digests: the copy of a registered adapter's files that backends read, and its SHA-256

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07 22:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('adapter') as batch:
        batch.add_column(sa.Column('stored_path', sqlmodel.sql.sqltypes.AutoString(length=1024), nullable=True))
        batch.add_column(sa.Column('digest', sqlmodel.sql.sqltypes.AutoString(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('adapter') as batch:
        batch.drop_column('digest')
        batch.drop_column('stored_path')
