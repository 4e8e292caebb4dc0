"""Schema migrations (torchrelay/server/migrations): a fresh store, an older versioned store and an
older unversioned one all end at this server's schema, keep their rows, and fill the new
columns in once; on SQLite and on PostgreSQL."""
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from torchrelay.errors import StoreUnavailable
from torchrelay.server import migrations
from torchrelay.server.store import Base, make_engine


def _at_first_revision(url: str, *, versioned: bool) -> None:
    """The store as the first server left it (revision 0001), with a job on its second attempt
    stopped at its max_runtime_s, a job still waiting and a node; ``versioned=False``: as a
    server from before migrations left it (no ``alembic_version``)."""
    engine = create_engine(url)
    with engine.begin() as conn:
        command.upgrade(migrations._config(conn), "0001")
        if not versioned:
            conn.execute(text("DROP TABLE alembic_version"))
        job = text("INSERT INTO jobs (seq, name, state, spec, priority, submitted_at, started_at, attempt, restarts, "
                   "restart_reasons, last_metrics, requeue) VALUES (:seq, 't', :state, '{}', 0, 1.0, :started, "
                   ":attempt, 0, '[]', '{}', false)")
        conn.execute(job, dict(seq=1, state="RUNNING", started=12.0, attempt=2))
        conn.execute(job, dict(seq=2, state="QUEUED", started=None, attempt=0))
        for time, state in [(1.0, "QUEUED"), (10.0, "SCHEDULED"), (12.0, "RUNNING"), (50.0, "RESTARTING"),
                            (55.0, "RESTARTING"), (60.0, "RUNNING")]:
            conn.execute(text("INSERT INTO job_events (job_seq, time, state, message) VALUES (1, :t, :s, '')"),
                         dict(t=time, s=state))
        conn.execute(text("INSERT INTO nodes (id, name, address, cpus, gpus, memory, labels, state, last_seen) "
                          "VALUES ('n', 'a', '127.0.0.1', 1, 0, 0, '{}', 'READY', 0)"))
        launch = text("INSERT INTO launches (id, job_seq, attempt, node_id, node_rank, nnodes, nproc, rank_offset, "
                      "world_size, cpu, gpu, memory, desired, stop_reason, state, ranks, stopped, message, infra) "
                      "VALUES (:id, 1, :attempt, 'n', 0, 1, 1, 0, 1, 1, 0, 0, 'stop', :reason, :state, '[]', "
                      "false, '', false)")
        conn.execute(launch, dict(id="job-1-a1-n0", attempt=1, reason="attempt 1 failed: x", state="exited"))
        conn.execute(launch, dict(id="job-1-a2-n0", attempt=2, reason="ran past max_runtime_s=30 s (attempt 2 ran 31 s)",
                                  state="running"))
    engine.dispose()


def _schema_differences(engine) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), Base.metadata)


def test_a_fresh_store_is_at_head_and_matches_the_models(db_url):
    engine = make_engine(db_url)
    try:
        assert migrations.revision(engine) == migrations.HEAD
        assert _schema_differences(engine) == []
    finally:
        engine.dispose()


@pytest.mark.parametrize("versioned", [True, False], ids=["versioned", "before-migrations"])
def test_an_older_store_is_upgraded_in_place_and_keeps_its_jobs(db_url, versioned):
    _at_first_revision(db_url, versioned=versioned)
    engine = make_engine(db_url)
    try:
        assert migrations.revision(engine) == migrations.HEAD
        assert _schema_differences(engine) == []
        with engine.connect() as conn:
            assert dict(conn.execute(text("SELECT seq, state FROM jobs")).all()) == {1: "RUNNING", 2: "QUEUED"}
            # the second attempt's placement; a waiting job has none
            assert dict(conn.execute(text("SELECT seq, placed_at FROM jobs")).all()) == {1: 55.0, 2: None}
            kinds = dict(conn.execute(text("SELECT id, stop_kind FROM launches")).all())
            assert kinds == {"job-1-a1-n0": None, "job-1-a2-n0": "runtime"}
        with engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET placed_at = 99 WHERE seq = 1"))
    finally:
        engine.dispose()
    again = make_engine(db_url)  # idempotent: nothing is added or filled in twice
    try:
        with again.connect() as conn:
            assert conn.execute(text("SELECT placed_at FROM jobs WHERE seq = 1")).scalar() == 99.0
    finally:
        again.dispose()


def test_a_store_that_cannot_be_reached_names_the_url_without_its_password_and_the_reason(postgres):
    port = postgres.port
    postgres_url = f"postgresql+psycopg://relay:s3cret@127.0.0.1:{port}/no_such_db"
    with pytest.raises(StoreUnavailable) as err:
        make_engine(postgres_url)
    message = str(err.value)
    assert f"postgresql+psycopg://relay:***@127.0.0.1:{port}/no_such_db" in message
    assert "s3cret" not in message and 'role "relay" does not exist' in message  # the driver's reason


def test_a_database_server_that_is_not_there_is_named_with_the_reason(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StoreUnavailable, match=rf"127\.0\.0\.1:{port}/relay: .*(refused|failed)"):
        make_engine(f"postgresql+psycopg://relay:pw@127.0.0.1:{port}/relay")
