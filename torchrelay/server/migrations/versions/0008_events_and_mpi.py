"""node_events, event_cursors and launches.mpi: node state changes in order, how far each
``--events`` sink got, and node 0's MPI world of an mpirun job.

A store a server from before migrations made may have them already (its start made them).

Revision ID: 0008
Revises: 0007
"""
import sqlalchemy as sa
from alembic import op

from torchrelay.server.migrations import add_column_once

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    tables = set(sa.inspect(op.get_bind()).get_table_names())
    if "node_events" not in tables:
        op.create_table(
            "node_events",
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("node_id", sa.String(64), nullable=False),
            sa.Column("node_name", sa.String(256), nullable=False),
            sa.Column("time", sa.Float, nullable=False),
            sa.Column("state", sa.String(16), nullable=False),
        )
        op.create_index("ix_node_events_node_id", "node_events", ["node_id"])
    if "event_cursors" not in tables:
        op.create_table(
            "event_cursors",
            sa.Column("name", sa.String(512), primary_key=True),
            sa.Column("seq", sa.Integer, nullable=False),
        )
    add_column_once("launches", sa.Column("mpi", sa.JSON, nullable=True))
