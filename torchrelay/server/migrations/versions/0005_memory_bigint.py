"""nodes.memory and launches.memory as 64-bit integers: bytes pass 2**31 on any real node.

SQLite's INTEGER already holds 64 bits; PostgreSQL's does not, and refused the registration
of a node with more than 2 GiB. (Batch mode: SQLite alters a column by copying its table.)

Revision ID: 0005
Revises: 0004
"""
import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("nodes", "launches"):
        with op.batch_alter_table(table) as batch:
            batch.alter_column("memory", type_=sa.BigInteger, existing_type=sa.Integer, existing_nullable=False)
