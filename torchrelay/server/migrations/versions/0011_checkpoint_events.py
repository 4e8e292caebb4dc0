"""job_events.kind and job_events.detail: a checkpoint commit is a job event with its step,
attempt and URL (``torchrelay/server/events``); the rows before it are state events (NULL).

Revision ID: 0011
Revises: 0010
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("job_events", sa.Column("kind", sa.String(16), nullable=True))
    add_column_once("job_events", sa.Column("detail", sa.JSON, nullable=True))
