"""A data dir an older server wrote: the columns this server added appear, filled in, once."""
import sqlite3

from sqlalchemy import inspect

from torchrelay.server.store import make_engine


def old_data_dir(path):
    """A state.db as the server before ``placed_at`` and ``stop_kind`` left it, with a job on
    its second attempt, stopped at its max_runtime_s, and a job still waiting."""
    make_engine(f"sqlite:///{path}").dispose()
    db = sqlite3.connect(path)
    db.execute("ALTER TABLE jobs DROP COLUMN placed_at")
    db.execute("ALTER TABLE launches DROP COLUMN stop_kind")
    job = ("INSERT INTO jobs (seq, name, state, spec, priority, submitted_at, started_at, attempt, restarts, "
           "restart_reasons, last_metrics, requeue) VALUES (?, 't', ?, '{}', 0, 1.0, ?, ?, 0, '[]', '{}', 0)")
    db.execute(job, (1, "RUNNING", 12.0, 2))
    db.execute(job, (2, "QUEUED", None, 0))
    events = [(1.0, "QUEUED", "submitted"), (10.0, "SCHEDULED", "placed on a×1"),
              (12.0, "RUNNING", "attempt 1 running"), (50.0, "RESTARTING", "restart 1 of 1: x"),
              (55.0, "RESTARTING", "attempt 2 placed on a×1"), (60.0, "RUNNING", "attempt 2 running")]
    for time, state, message in events:
        db.execute("INSERT INTO job_events (job_seq, time, state, message) VALUES (1, ?, ?, ?)", (time, state, message))
    db.execute("INSERT INTO nodes (id, name, address, cpus, gpus, memory, labels, state, last_seen) "
               "VALUES ('n', 'a', '127.0.0.1', 1, 0, 0, '{}', 'READY', 0)")
    launch = ("INSERT INTO launches (id, job_seq, attempt, node_id, node_rank, nnodes, nproc, rank_offset, world_size, "
              "cpu, gpu, memory, desired, stop_reason, state, ranks, stopped, message, infra) "
              "VALUES (?, 1, ?, 'n', 0, 1, 1, 0, 1, 1, 0, 0, ?, ?, ?, '[]', 0, '', 0)")
    db.execute(launch, ("job-1-a1-n0", 1, "stop", "attempt 1 failed: x", "exited"))
    db.execute(launch, ("job-1-a2-n0", 2, "stop", "ran past max_runtime_s=30 s (attempt 2 ran 31 s)", "running"))
    db.commit()
    db.close()


def columns(engine, table):
    return {c["name"] for c in inspect(engine).get_columns(table)}


def test_an_older_data_dir_gets_the_new_columns_filled_in_once(tmp_path):
    path = tmp_path / "state.db"
    old_data_dir(path)
    engine = make_engine(f"sqlite:///{path}")
    assert "placed_at" in columns(engine, "jobs") and "stop_kind" in columns(engine, "launches")
    with engine.connect() as conn:
        placed = dict(conn.exec_driver_sql("SELECT seq, placed_at FROM jobs").all())
        kinds = dict(conn.exec_driver_sql("SELECT id, stop_kind FROM launches").all())
    assert placed == {1: 55.0, 2: None}  # the second attempt's placement; a waiting job has none
    assert kinds == {"job-1-a1-n0": None, "job-1-a2-n0": "runtime"}
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE jobs SET placed_at = 99 WHERE seq = 1")
    engine.dispose()
    again = make_engine(f"sqlite:///{path}")  # idempotent: nothing is added or filled in twice
    with again.connect() as conn:
        assert conn.exec_driver_sql("SELECT placed_at FROM jobs WHERE seq = 1").scalar() == 99.0
    again.dispose()
