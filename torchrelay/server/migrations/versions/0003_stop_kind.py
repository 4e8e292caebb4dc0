"""launches.stop_kind: why the server asked a launch to stop (a ``views.StopKind`` value).

An older server marked a max_runtime_s stop by the reason's wording alone.

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("launches", sa.Column("stop_kind", sa.String(16), nullable=True),
                    "UPDATE launches SET stop_kind = 'runtime' WHERE stop_reason LIKE 'ran past max_runtime_s%'")
