"""launches.released: the ranks of a running elastic launch the server asked to leave (a shrink).

Revision ID: 0010
Revises: 0009
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("launches", sa.Column("released", sa.JSON, nullable=True))
