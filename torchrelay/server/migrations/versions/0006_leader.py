"""cluster: the cluster's identity (made once, with the store) and which server leads it.

``cluster_id`` tells two servers on one database (one cluster) from two servers on two
databases that clients were told are one; the leader writes ``leader_url`` when elected.

Revision ID: 0006
Revises: 0005
"""
import time
import uuid

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "cluster",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("cluster_id", sa.String(64), nullable=False),
        sa.Column("leader_url", sa.String(256), nullable=True),
        sa.Column("leader_since", sa.Float, nullable=True),
    )
    op.bulk_insert(table, [{"id": 1, "cluster_id": uuid.uuid4().hex, "leader_url": None,
                            "leader_since": time.time()}])
