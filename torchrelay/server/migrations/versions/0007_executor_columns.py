"""nodes.note and launches.external_id: what an executor other than the agents (Slurm) keeps.

``note``: what the node's executor last said of it (e.g. "slurmctld unreachable since …");
``external_id``: the executor's own id of a launch's attempt (a Slurm job id). A store a server
from before migrations made may have them already (its start added them).

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("nodes", sa.Column("note", sa.Text, nullable=True))
    add_column_once("launches", sa.Column("external_id", sa.String(64), nullable=True))
