"""operator scope: the global administration `admin` used to grant

`admin` now administers the key's own tenant only. Admin keys of the `default` tenant (where the
bootstrap admin key lives) keep global administration as `operator`; admin keys of any other
tenant become tenant administrators.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 07:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEYS = sa.table("api_key", sa.column("id", sa.Integer), sa.column("tenant_id", sa.Integer),
                sa.column("scopes", sa.String))
TENANTS = sa.table("tenant", sa.column("id", sa.Integer), sa.column("name", sa.String))


def _rewrite(old: str, new: str) -> None:
    connection = op.get_bind()
    default = sa.select(TENANTS.c.id).where(TENANTS.c.name == "default").scalar_subquery()
    rows = connection.execute(sa.select(KEYS.c.id, KEYS.c.scopes).where(KEYS.c.tenant_id == default)).all()
    for key_id, scopes in rows:
        names = scopes.split(",")
        if old in names:
            names = sorted({new if name == old else name for name in names})
            connection.execute(KEYS.update().where(KEYS.c.id == key_id).values(scopes=",".join(names)))


def upgrade() -> None:
    _rewrite("admin", "operator")


def downgrade() -> None:
    _rewrite("operator", "admin")
