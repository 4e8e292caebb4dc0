"""leader: which server of the cluster leads (one row), written by the leader when elected.

Revision ID: 0006
Revises: 0005
"""
import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leader",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("url", sa.String(256), nullable=False),
        sa.Column("since", sa.Float, nullable=False),
    )
