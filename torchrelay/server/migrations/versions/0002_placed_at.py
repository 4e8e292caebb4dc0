"""jobs.placed_at: when the current attempt was placed (what max_runtime_s counts from).

An older server found the attempt's placement in the job's events: the latest event of the
states an attempt is placed in (SCHEDULED, or RESTARTING for a restart) is that moment.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa

from torchrelay.server.migrations import add_column_once

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    add_column_once("jobs", sa.Column("placed_at", sa.Float, nullable=True),
                    "UPDATE jobs SET placed_at = COALESCE((SELECT MAX(e.time) FROM job_events e "
                    "WHERE e.job_seq = jobs.seq AND e.state IN ('SCHEDULED', 'RESTARTING')), "
                    "started_at, submitted_at) WHERE attempt > 0")
