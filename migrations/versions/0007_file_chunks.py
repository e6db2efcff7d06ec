"""file chunks: files' bytes in chunks (or a directory) instead of one column, files' status, expiry index

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-08 10:00:00
"""

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
import sqlmodel
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

String = sqlmodel.sql.sqltypes.AutoString
CHUNK_BYTES = 1024 * 1024  # gateway/files.py's, as of this revision


def upgrade() -> None:
    op.create_table('file_chunk',
    sa.Column('file_id', String(length=64), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('data', sa.LargeBinary(), nullable=False),
    sa.PrimaryKeyConstraint('file_id', 'seq')
    )
    connection = op.get_bind()
    file = sa.table('file', sa.column('id', String()), sa.column('content', sa.LargeBinary()))
    chunk = sa.table('file_chunk', sa.column('file_id', String()), sa.column('seq', sa.Integer()),
                     sa.column('data', sa.LargeBinary()))
    for (file_id,) in connection.execute(sa.select(file.c.id)).all():  # one file's bytes in memory at a time
        content = connection.execute(sa.select(file.c.content).where(file.c.id == file_id)).scalar_one()
        for seq, start in enumerate(range(0, len(content), CHUNK_BYTES)):
            connection.execute(chunk.insert().values(file_id=file_id, seq=seq,
                                                     data=content[start:start + CHUNK_BYTES]))
    with op.batch_alter_table('file') as table:
        table.add_column(sa.Column('status', String(length=16), nullable=False, server_default='processed'))
        table.add_column(sa.Column('directory', String(length=1024), nullable=True))
        table.drop_column('content')
        table.create_index('ix_file_expires_at', ['expires_at'])


def downgrade() -> None:
    with op.batch_alter_table('file') as table:
        table.add_column(sa.Column('content', sa.LargeBinary(), nullable=True))
    connection = op.get_bind()
    file = sa.table('file', sa.column('id', String()), sa.column('directory', String()),
                    sa.column('content', sa.LargeBinary()))
    chunk = sa.table('file_chunk', sa.column('file_id', String()), sa.column('seq', sa.Integer()),
                     sa.column('data', sa.LargeBinary()))
    for file_id, directory in connection.execute(sa.select(file.c.id, file.c.directory)).all():
        if directory is None:
            content = b''.join(connection.execute(sa.select(chunk.c.data).where(chunk.c.file_id == file_id)
                                                  .order_by(chunk.c.seq)).scalars())
        else:
            path = Path(directory) / file_id
            content = path.read_bytes() if path.exists() else b''
        connection.execute(file.update().where(file.c.id == file_id).values(content=content))
    with op.batch_alter_table('file') as table:
        table.drop_index('ix_file_expires_at')
        table.drop_column('directory')
        table.drop_column('status')
        table.alter_column('content', existing_type=sa.LargeBinary(), nullable=False)
    op.drop_table('file_chunk')
