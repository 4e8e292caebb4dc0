"""nodes.problem: why a READY node gets no work (its address is out of the other hosts' reach).

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("nodes", sa.Column("problem", sa.Text, nullable=True))
