"""MPI jobs (``launcher: mpirun``) in an embedded cluster: two agents, one Open MPI world.

Real Open MPI (Debian's 4.1: mpirun, orted), real mpi4py, no ssh: node 0's agent starts mpirun,
whose remote shell hands node 1's daemon to node 1's agent through the server (docs/mpi.md).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState
from torchrelay.wire import MPIRUN_LABEL

pytestmark = pytest.mark.timeout(240)
mpi4py = pytest.importorskip("mpi4py", reason="mpi4py is in the channels extra (make venv)")
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "mpi"


@pytest.fixture(scope="module", autouse=True)
def open_mpi() -> None:
    """Open MPI here (installed when missing), or every test of this file skips with the reason."""
    from services.apt import open_mpi_unavailable

    reason = open_mpi_unavailable()
    if reason:
        pytest.skip(reason)


def mpi_spec(entrypoint: str, **extra) -> JobSpec:
    return JobSpec.parse({"name": "mpi", "entrypoint": entrypoint, "nodes": 2, "workers_per_node": 2,
                          "launcher": "mpirun", **extra})


def job_processes(home: Path) -> list[tuple[int, str]]:
    """Live processes of this cluster's jobs: anything whose environment names a launch folder
    under ``home`` (mpirun, orted, the ranks and their exit hooks), with its command line."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(") ", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and f"RELAY_LAUNCH_DIR={home}".encode() in env:
            out.append((int(entry.name), cmd))
    return out


def wait_gone(home: Path, timeout: float = 20.0) -> list:
    deadline = time.monotonic() + timeout
    while (left := job_processes(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def mpi_cluster(tmp_path_factory):
    """Three agents for the module: two with Open MPI, one told it has none (``pool: plain``)."""
    from conftest import group_members
    from torchrelay.client.cluster import start_cluster, stop_cluster

    options = [AgentOptions(), AgentOptions(), AgentOptions(labels={MPIRUN_LABEL[0]: "no", "pool": "plain"})]
    cluster = start_cluster(3, home=tmp_path_factory.mktemp("mpi-home"), agent_options=options)
    try:
        yield cluster
    finally:
        stop_cluster(cluster.home)
        for pid in cluster.pids:
            assert group_members(pid) == [], f"processes left in group {pid}"


def test_unchanged_mpi4py_script_is_one_world_across_two_agents(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:
        info = c.submit(mpi_spec("python hello_mpi.py"), base_dir=JOBS)
        final = c.wait(info.id, timeout=120)
        assert final.state == JobState.SUCCEEDED, final.failure
        assert sorted(p.node_name for p in final.placement) == ["agent-0", "agent-1"]  # not agent-2
        lines = {(line.rank, line.text) for line in c.iter_logs(info.id)}
    assert {(r, f"mpi rank {r}/4 sum=10") for r in range(4)} <= lines  # each rank's own log, by rank
    # node 1's ranks ran under the daemon its own agent started, and wrote their rank logs there
    node1 = {p.node_rank: p.node_name for p in final.placement}[1]
    launch = mpi_cluster.home / "agents" / node1 / "launches" / f"{info.id}-a1-n1"
    assert "orted" in (launch / "orted.log").read_text()
    assert sorted(p.name for p in (launch / "logs").iterdir()) == ["rank-2.log", "rank-3.log"]
    assert wait_gone(mpi_cluster.home) == []


def test_ddp_script_launched_by_mpirun_trains_and_checkpoints_with_torchrelay_train(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:
        info = c.submit(mpi_spec("python ddp_mpi.py", workers_per_node=1), base_dir=JOBS)  # torch: 2 ranks
        final = c.wait(info.id, timeout=150)
        assert final.state == JobState.SUCCEEDED, final.failure
        texts = [line.text for line in c.iter_logs(info.id)]
    done = [t for t in texts if t.startswith("ddp rank ")]
    assert len(done) == 2 and all("same on all ranks" in t for t in done), texts
    assert len({t.split("params=")[1] for t in done}) == 1
    assert final.last_metrics.get("loss") is not None  # rt.report's metrics reached the server
    committed = mpi_cluster.home / "store" / "jobs" / info.id / "checkpoints" / "step-0000000005"
    assert (committed / "MANIFEST.json").exists()  # TrainState's checkpoint, committed by both ranks


def test_failing_rank_is_blamed_and_the_whole_world_ends(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:
        info = c.submit(mpi_spec("python hello_mpi.py fail"), base_dir=JOBS)
        final = c.wait(info.id, timeout=120)
    assert final.state == JobState.FAILED
    failure = final.failure
    node1 = {p.node_rank: p.node_name for p in final.placement}[1]  # ranks 2 and 3
    assert (failure.rank, failure.exit_code, failure.node) == (3, 3, node1), failure
    assert any("rank about to fail with code 3" in line for line in failure.last_lines), failure.last_lines
    assert wait_gone(mpi_cluster.home) == []  # the ranks waiting in the barrier were ended


def test_a_failed_mpi_world_restarts_as_a_new_world(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:
        info = c.submit(mpi_spec("python hello_mpi.py fail-once", max_restarts=1), base_dir=JOBS)
        final = c.wait(info.id, timeout=150)
        assert final.state == JobState.SUCCEEDED, final.failure
        assert final.restarts == 1 and final.restart_reasons[0].rank == 3, final.restart_reasons
        texts = [(line.attempt, line.text) for line in c.iter_logs(info.id)]
    assert {(2, f"mpi rank {r}/4 sum=10") for r in range(4)} <= set(texts)
    assert wait_gone(mpi_cluster.home) == []


def test_cancel_ends_mpirun_daemons_and_ranks_on_every_node(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:
        info = c.submit(mpi_spec("python hello_mpi.py sleep", stop_grace_s=5), base_dir=JOBS)
        working: set[int] = set()
        for line in c.follow_logs(info.id):
            if "still working" in line.text:
                working.add(line.rank)
                if len(working) == 4:
                    break
        running = [cmd for _, cmd in job_processes(mpi_cluster.home)]
        assert any("mpirun" in cmd for cmd in running) and any("orted" in cmd for cmd in running), running
        c.cancel(info.id)
        final = c.wait(info.id, timeout=60)
    assert final.state == JobState.CANCELLED
    assert wait_gone(mpi_cluster.home) == []


def test_mpirun_job_waits_where_no_node_has_open_mpi(mpi_cluster):
    with RelayClient(mpi_cluster.address) as c:  # the only node of pool "plain" has no Open MPI
        info = c.submit(mpi_spec("python hello_mpi.py", nodes=1, workers_per_node=1, labels={"pool": "plain"}),
                        base_dir=JOBS)
        deadline = time.monotonic() + 30
        while True:
            rows = {row["id"]: row for row in c.queue()}
            reason = rows.get(info.id, {}).get("reason") or ""
            if "mpirun" in reason or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert reason.startswith("unschedulable") and "relay.mpirun=yes" in reason and "openmpi-bin" in reason, rows
        assert c.job(info.id).state == JobState.QUEUED
        c.cancel(info.id)
