"""The store as the first servers made it: jobs, events, nodes, launches, logs, metrics, cursors.

Revision ID: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    _jobs()
    _nodes_and_launches()
    _telemetry()


def _jobs() -> None:
    op.create_table(
        "jobs",
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("user", sa.String(128), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("bundle", sa.String(64), nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("submitted_at", sa.Float, nullable=False),
        sa.Column("started_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("failure", sa.JSON, nullable=True),
        sa.Column("restart_reasons", sa.JSON, nullable=False),
        sa.Column("waiting_reason", sa.Text, nullable=True),
        sa.Column("last_metrics", sa.JSON, nullable=False),
        sa.Column("requeue", sa.Boolean, nullable=False),
        sa.Column("last_progress_at", sa.Float, nullable=True),
        sa.Column("hung_attempt", sa.Integer, nullable=True),
    )
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_table(
        "job_events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_seq", sa.Integer, sa.ForeignKey("jobs.seq"), nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("message", sa.Text, nullable=False),
    )
    op.create_index("ix_job_events_job_seq", "job_events", ["job_seq"])


def _nodes_and_launches() -> None:
    op.create_table(
        "nodes",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("address", sa.String(256), nullable=False),
        sa.Column("cpus", sa.Float, nullable=False),
        sa.Column("gpus", sa.Integer, nullable=False),
        sa.Column("gpu_type", sa.String(64), nullable=True),
        sa.Column("memory", sa.Integer, nullable=False),
        sa.Column("labels", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("last_seen", sa.Float, nullable=False),
    )
    op.create_table(
        "launches",
        sa.Column("id", sa.String(96), primary_key=True),
        sa.Column("job_seq", sa.Integer, sa.ForeignKey("jobs.seq"), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("node_id", sa.String(64), sa.ForeignKey("nodes.id"), nullable=False),
        sa.Column("node_rank", sa.Integer, nullable=False),
        sa.Column("nnodes", sa.Integer, nullable=False),
        sa.Column("nproc", sa.Integer, nullable=False),
        sa.Column("rank_offset", sa.Integer, nullable=False),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("cpu", sa.Float, nullable=False),
        sa.Column("gpu", sa.Integer, nullable=False),
        sa.Column("memory", sa.Integer, nullable=False),
        sa.Column("desired", sa.String(8), nullable=False),
        sa.Column("stop_reason", sa.Text, nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("master_port", sa.Integer, nullable=True),
        sa.Column("ranks", sa.JSON, nullable=False),
        sa.Column("succeeded", sa.Boolean, nullable=True),
        sa.Column("stopped", sa.Boolean, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("infra", sa.Boolean, nullable=False),
        sa.Column("stop_grace_s", sa.Float, nullable=True),
    )
    op.create_index("ix_launches_job_seq", "launches", ["job_seq"])
    op.create_index("ix_launches_node_id", "launches", ["node_id"])
    op.create_index("ix_launch_node_state", "launches", ["node_id", "state"])


def _telemetry() -> None:
    op.create_table(
        "logs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_seq", sa.Integer, nullable=False),
        sa.Column("launch_id", sa.String(96), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("stream", sa.String(8), nullable=False),
        sa.Column("agent_seq", sa.Integer, nullable=False),
        sa.Column("text", sa.Text, nullable=False),
    )
    op.create_index("ix_logs_job_seq", "logs", ["job_seq"])
    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_seq", sa.Integer, nullable=False),
        sa.Column("launch_id", sa.String(96), nullable=False),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("agent_seq", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("values", sa.JSON, nullable=False),
    )
    op.create_index("ix_metrics_job_seq", "metrics", ["job_seq"])
    op.create_table(
        "ingest_cursors",
        sa.Column("key", sa.String(160), primary_key=True),
        sa.Column("last_seq", sa.Integer, nullable=False),
    )
