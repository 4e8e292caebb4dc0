"""SQL state store (SQLAlchemy 2): jobs, events, nodes, launches, logs, metrics.

Everything the server knows lives here, so a server killed and started again loses nothing.
SQLite (WAL, busy timeout) is the embedded default; any SQLAlchemy URL works (PostgreSQL for
several hosts). This module only maps the tables and opens the database; ``rows.py`` reads and
writes them, and the rules live in the decision modules (``lifecycle``, ``failures``,
``watchdogs``).

``make_engine`` migrates the store to this server's schema (alembic revisions in
``migrations/versions``: a store an older server made keeps its rows) and raises
``StoreUnavailable`` with the URL (password hidden) and the driver's reason when the database
cannot be reached. The models here and the migrated schema must agree
(``tests/unit/test_migrations.py``).
"""
from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, create_engine, event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from torchrelay.errors import StoreUnavailable
from torchrelay.server import migrations
from torchrelay.server.views import job_id_of


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    user: Mapped[str | None] = mapped_column(String(128), nullable=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    bundle: Mapped[str | None] = mapped_column(String(64), nullable=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    submitted_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    failure: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    restart_reasons: Mapped[list[Any]] = mapped_column(JSON, default=list)
    waiting_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    last_metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # set when the current attempt must be torn down and the job go back to QUEUED afterwards
    requeue: Mapped[bool] = mapped_column(Boolean, default=False)
    # server time of the last metric of the current attempt (hang detection)
    last_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    hung_attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # server time the current attempt was placed: what max_runtime_s counts from
    placed_at: Mapped[float | None] = mapped_column(Float, nullable=True)

    @property
    def id(self) -> str:
        return job_id_of(self.seq)


class EventRow(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq"), index=True)
    time: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text, default="")
    # None: a state change, placement, restart or stop request; "checkpoint": a commit its workers
    # posted, ``detail`` {"step", "attempt", "url"} (server.events.model)
    kind: Mapped[str | None] = mapped_column(String(16), nullable=True)
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class NodeRow(Base):
    __tablename__ = "nodes"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    address: Mapped[str] = mapped_column(String(256))
    cpus: Mapped[float] = mapped_column(Float)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpu_type: Mapped[str | None] = mapped_column(String(64), nullable=True)
    memory: Mapped[int] = mapped_column(BigInteger)  # bytes: past 2**31 on any real node
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(16))
    last_seen: Mapped[float] = mapped_column(Float)
    # what its executor last said of it (e.g. "slurmctld unreachable since …"); None for agents
    note: Mapped[str | None] = mapped_column(Text, nullable=True)
    # why no work is placed here although READY (its address is out of reach); None: none
    problem: Mapped[str | None] = mapped_column(Text, nullable=True)


class LaunchRow(Base):
    __tablename__ = "launches"

    id: Mapped[str] = mapped_column(String(96), primary_key=True)
    job_seq: Mapped[int] = mapped_column(ForeignKey("jobs.seq"), index=True)
    attempt: Mapped[int] = mapped_column(Integer)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.id"), index=True)
    node_rank: Mapped[int] = mapped_column(Integer)
    nnodes: Mapped[int] = mapped_column(Integer)
    nproc: Mapped[int] = mapped_column(Integer)
    rank_offset: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    cpu: Mapped[float] = mapped_column(Float, default=0)
    gpu: Mapped[int] = mapped_column(Integer, default=0)
    memory: Mapped[int] = mapped_column(BigInteger, default=0)
    desired: Mapped[str] = mapped_column(String(8), default="run")
    stop_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # why the server asked it to stop: a ``torchrelay.server.views.StopKind`` value
    stop_kind: Mapped[str | None] = mapped_column(String(16), nullable=True)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    master_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ranks: Mapped[list[Any]] = mapped_column(JSON, default=list)
    succeeded: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    stopped: Mapped[bool] = mapped_column(Boolean, default=False)
    message: Mapped[str] = mapped_column(Text, default="")
    # failed for a reason outside the job (its node was lost): a restart does not count
    infra: Mapped[bool] = mapped_column(Boolean, default=False)
    # overrides the spec's stop_grace_s for this stop (0: `relay cancel --no-checkpoint`)
    stop_grace_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the executor's own id of the launch's attempt (a Slurm job id); None for an agent's launch
    external_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    # node 0 of an mpirun job: its MPI world (``wire.MpiWorld``: slots, and the daemons handed over)
    mpi: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # an elastic launch: the global ranks the server asked to leave (a shrink), None when none
    released: Mapped[list[Any] | None] = mapped_column(JSON, nullable=True)

    __table_args__ = (Index("ix_launch_node_state", "node_id", "state"),)


class NodeEventRow(Base):
    """A node's state change (registered READY, LOST, DRAINING, READY again), in order."""

    __tablename__ = "node_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(64), index=True)
    node_name: Mapped[str] = mapped_column(String(256))
    time: Mapped[float] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))


class EventCursorRow(Base):
    """How far each ``--events`` sink got in each feed: the last seq its broker confirmed."""

    __tablename__ = "event_cursors"

    name: Mapped[str] = mapped_column(String(512), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, default=0)


class LogRow(Base):
    __tablename__ = "logs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(Integer, index=True)
    launch_id: Mapped[str] = mapped_column(String(96))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    agent_seq: Mapped[int] = mapped_column(Integer)
    text: Mapped[str] = mapped_column(Text)


class MetricRow(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_seq: Mapped[int] = mapped_column(Integer, index=True)
    launch_id: Mapped[str] = mapped_column(String(96))
    rank: Mapped[int] = mapped_column(Integer)
    agent_seq: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Float)
    values: Mapped[dict[str, float]] = mapped_column(JSON)


class CursorRow(Base):
    """Highest agent sequence number stored per (launch, rank, stream): makes resends harmless."""

    __tablename__ = "ingest_cursors"

    key: Mapped[str] = mapped_column(String(160), primary_key=True)
    last_seq: Mapped[int] = mapped_column(Integer)


class ClusterRow(Base):
    """The cluster's identity and leader (one row, id 1, made with the store): ``cluster_id``
    is random; the server that is elected writes itself as ``leader_url`` (``leadership.py``)."""

    __tablename__ = "cluster"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    cluster_id: Mapped[str] = mapped_column(String(64))
    leader_url: Mapped[str | None] = mapped_column(String(256), nullable=True)
    leader_since: Mapped[float | None] = mapped_column(Float, nullable=True)


class UserRow(Base):
    """A person (or service account) that holds user tokens; ``role`` is "admin" or "user"."""

    __tablename__ = "users"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[float] = mapped_column(Float)


class TokenRow(Base):
    """A credential, stored as the sha256 of its text (``auth.py``): a user's token, a node
    enrolment token, or the credential one node got at its enrolment (``node_id``)."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    user_name: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    label: Mapped[str] = mapped_column(String(128), default="")
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AuthKeyRow(Base):
    """The server's secret (one row, id 1) that worker tokens are an HMAC of (``auth.py``)."""

    __tablename__ = "auth_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    secret: Mapped[str] = mapped_column(String(128))


def make_engine(url: str) -> Engine:
    """Engine for ``url``, its store migrated to this server's schema; SQLite gets WAL, a busy
    timeout and foreign keys. Raises ``StoreUnavailable`` (see the module docstring)."""
    is_sqlite = url.startswith("sqlite")
    engine = create_engine(url, future=True,
                           connect_args={"check_same_thread": False, "timeout": 30} if is_sqlite
                           else {"connect_timeout": 10},
                           pool_pre_ping=not is_sqlite)
    if is_sqlite:
        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()
    try:
        migrations.upgrade(engine)
    except OperationalError as exc:
        engine.dispose()
        shown = make_url(url).render_as_string(hide_password=True)
        reason = str(exc.orig).strip() if exc.orig is not None else str(exc)
        raise StoreUnavailable(f"cannot open the state store {shown}: {reason}") from None
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False, future=True)
