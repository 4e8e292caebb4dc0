"""Server rules on a real SQLite file, driven through the service's own API as agents would."""
import pytest

from torchrelay.errors import NotFound, Unschedulable
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState, LaunchState
from torchrelay.wire import Heartbeat, LaunchReport, LaunchStatus, LaunchStatusReport, LogBatch, LogRecord, \
    MetricBatch, MetricRecord, NodeRegistration, RankExit


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def svc(tmp_path, db_url):  # every service test runs on SQLite and on PostgreSQL (conftest's db_url)
    clock = Clock()
    service = ClusterService(db_url, str(tmp_path / "store"),
                             heartbeat_timeout_s=10, clock=clock)
    service.clock_ref = clock
    yield service
    service.stop()


def add_node(svc, name, cpus=2, memory=8 * 2**30):
    return svc.register(NodeRegistration(name=name, address="127.0.0.1", cpus=cpus, memory=memory)).node_id


def spec(workers=2, **kw):
    return {"name": "t", "entrypoint": "python train.py", "workers": workers, **kw}


def launches_of(svc, node_id):
    return svc.desired(node_id).launches


def running_job(svc, node_id, **spec_fields):
    """Submit a one-worker job, place it on ``node_id`` and report it running: (job, launch)."""
    job = svc.submit(spec(workers=1, **spec_fields), None, None)
    svc.tick()
    (launch,) = launches_of(svc, node_id)
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    return job, launch


def lose_node(svc, keep_alive_node_id):
    """Let every node but ``keep_alive_node_id`` miss its heartbeats past the timeout."""
    svc.clock_ref.now += 11
    svc.heartbeat(keep_alive_node_id, Heartbeat())
    svc.tick()


def exit_launch(svc, launch_id, ok=True, code=0, returned=None):
    ranks = [RankExit(rank=0, exit_code=code, returned=ok if returned is None else returned, last_lines=["boom"])]
    svc.launch_status(launch_id, LaunchStatus(state="exited", succeeded=ok, ranks=ranks))


def test_submit_place_run_succeed(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=2), None, "alice")
    assert job.state == JobState.QUEUED and job.user == "alice"
    svc.tick()
    assert svc.get_job(job.id).state == JobState.SCHEDULED
    (launch,) = launches_of(svc, n1)
    assert launch.nproc_per_node == 2 and launch.world_size == 2 and launch.master_port is None
    svc.launch_status(launch.launch_id, LaunchStatus(state="preparing", master_port=4242))
    (launch,) = launches_of(svc, n1)
    assert launch.master_port == 4242 and launch.master_addr == "127.0.0.1"
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    assert svc.get_job(job.id).state == JobState.RUNNING
    exit_launch(svc, launch.launch_id)
    info = svc.get_job(job.id)
    assert info.state == JobState.SUCCEEDED
    assert [e.state for e in info.events] == [JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING,
                                              JobState.SUCCEEDED]
    assert launches_of(svc, n1) == []  # exited launches are no longer desired


def test_gang_spans_nodes_and_failure_stops_peers(svc):
    n1, n2 = add_node(svc, "a"), add_node(svc, "b")
    job = svc.submit(spec(workers=4), None, None)
    svc.tick()
    (l1,), (l2,) = launches_of(svc, n1), launches_of(svc, n2)
    assert {l1.node_rank, l2.node_rank} == {0, 1} and l1.world_size == 4
    assert sorted([l1.rank_offset, l2.rank_offset]) == [0, 2]
    for launch in (l1, l2):
        svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    exit_launch(svc, l1.launch_id, ok=False, code=3)
    (peer,) = launches_of(svc, n2)
    assert peer.desired == "stop"  # the other node is told to end its workers at once
    assert svc.get_job(job.id).state == JobState.RUNNING
    svc.launch_status(l2.launch_id, LaunchStatus(state="exited", succeeded=False, stopped=True,
                                                 ranks=[RankExit(rank=2, signal=15)]))
    info = svc.get_job(job.id)
    assert info.state == JobState.FAILED
    assert info.failure.rank == 0 and info.failure.exit_code == 3 and info.failure.last_lines == ["boom"]


def test_restarts_then_fails_after_max_restarts_plus_one(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1, max_restarts=2), None, None)
    launches = 0
    for _ in range(5):
        svc.tick()
        current = launches_of(svc, n1)
        if not current:
            break
        launches += 1
        svc.launch_status(current[0].launch_id, LaunchStatus(state="running"))
        exit_launch(svc, current[0].launch_id, ok=False, code=1)
    info = svc.get_job(job.id)
    assert launches == 3 and info.state == JobState.FAILED and info.restarts == 2
    assert len(info.restart_reasons) == 2 and info.attempt == 3


def test_sigabrt_after_return_counts_as_success(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(state="exited", succeeded=True,
                                                     ranks=[RankExit(rank=0, signal=6, returned=True)]))
    assert svc.get_job(job.id).state == JobState.SUCCEEDED


def test_cancel_queued_and_running(svc):
    n1 = add_node(svc, "a", cpus=1)
    running = svc.submit(spec(workers=1), None, None)
    queued = svc.submit(spec(workers=1), None, None)
    svc.tick()
    assert svc.get_job(queued.id).waiting_reason  # says why it waits
    assert svc.cancel(queued.id).state == JobState.CANCELLED
    assert svc.cancel(queued.id).state == JobState.CANCELLED  # idempotent
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    assert svc.cancel(running.id).state == JobState.CANCELLING
    (launch,) = launches_of(svc, n1)
    assert launch.desired == "stop" and launch.stop_reason == "job cancelled"
    svc.launch_status(launch.launch_id, LaunchStatus(state="exited", succeeded=False, stopped=True))
    assert svc.get_job(running.id).state == JobState.CANCELLED


def test_fifo_waits_for_resources_then_starts(svc):
    n1 = add_node(svc, "a", cpus=2)
    first = svc.submit(spec(workers=2), None, None)
    second = svc.submit(spec(workers=1), None, None)
    svc.tick()
    assert svc.get_job(second.id).state == JobState.QUEUED
    (launch,) = launches_of(svc, n1)
    exit_launch(svc, launch.launch_id)
    svc.tick()
    assert svc.get_job(first.id).state == JobState.SUCCEEDED
    assert svc.get_job(second.id).state == JobState.SCHEDULED


@pytest.mark.parametrize("bad", [spec(workers=5), spec(workers=1, resources={"cpu": 3}),
                                 spec(workers=1, resources={"memory": "1TiB"}), spec(workers=1, resources={"gpu": 1})])
def test_never_fits_is_refused_naming_sizes(svc, bad):
    add_node(svc, "a", cpus=2)
    add_node(svc, "b", cpus=2)
    with pytest.raises(Unschedulable) as err:
        svc.submit(bad, None, None)
    assert "can never run here" in str(err.value) and "cpus=4" in str(err.value)


def test_unknown_ids(svc):
    with pytest.raises(NotFound, match="job-99"):
        svc.get_job("job-99")
    with pytest.raises(NotFound, match="nonsense"):
        svc.cancel("nonsense")
    with pytest.raises(NotFound, match="bundle"):
        svc.submit(spec(), "ab" * 32, None)


def test_lost_node_fails_its_attempt_and_restart_goes_elsewhere(svc):
    n1 = add_node(svc, "a")
    job, _ = running_job(svc, n1, max_restarts=1)
    n2 = add_node(svc, "b")
    lose_node(svc, n2)  # n1 missed its heartbeats
    assert {n.name: n.state for n in svc.list_nodes()} == {"a": "LOST", "b": "READY"}
    svc.tick()
    info = svc.get_job(job.id)
    assert info.restarts == 0 and "lost" in info.restart_reasons[0].reason  # not the job's fault
    assert launches_of(svc, n2)[0].attempt == 2


def test_agent_that_forgot_a_launch_fails_it(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    svc.heartbeat(n1, Heartbeat(launches=[LaunchReport(launch_id=launch.launch_id, state="running")]))
    assert svc.get_job(job.id).state == JobState.RUNNING
    svc.heartbeat(n1, Heartbeat(launches=[]))  # e.g. the agent restarted
    assert svc.get_job(job.id).state == JobState.FAILED


def test_logs_and_metrics_resends_are_harmless(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    batch = LogBatch(launch_id=launch.launch_id, records=[LogRecord(rank=0, seq=i, text=f"line {i}") for i in range(3)])
    assert svc.ingest_logs(job.id, batch) == 3
    assert svc.ingest_logs(job.id, batch) == 0
    page = svc.logs(job.id)
    assert [x.text for x in page.lines] == ["line 0", "line 1", "line 2"]
    assert svc.logs(job.id, after=page.next_after).lines == []
    mb = MetricBatch(launch_id=launch.launch_id, records=[
        MetricRecord(rank=0, seq=i, step=i, time=1.0, values={"loss": 1.0 / (i + 1)}) for i in range(4)])
    assert svc.ingest_metrics(job.id, mb) == 4 and svc.ingest_metrics(job.id, mb) == 0
    assert svc.get_job(job.id).last_metrics["step"] == 3


def test_state_survives_a_new_service_on_the_same_file(tmp_path, db_url):
    url, store = db_url, str(tmp_path / "store")
    a = ClusterService(url, store)
    a.register(NodeRegistration(name="a", address="127.0.0.1", cpus=2, memory=2**30))
    ids = [a.submit(spec(workers=1), None, None).id for _ in range(3)]
    a.tick()
    before = [(j.id, j.state) for j in a.list_jobs()]
    a.stop()
    b = ClusterService(url, store)
    assert [(j.id, j.state) for j in b.list_jobs()] == before and sorted(ids) == sorted(x for x, _ in before)
    b.stop()


def test_no_progress_for_hang_timeout_restarts_the_attempt(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1, max_restarts=1, hang_timeout_s=30), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    svc.tick()
    assert launches_of(svc, n1)[0].desired == "run"  # no metric yet: never counted as hung
    svc.ingest_metrics(job.id, MetricBatch(launch_id=launch.launch_id, records=[
        MetricRecord(rank=0, seq=0, step=1, time=1.0, values={"loss": 1.0})]))
    svc.clock_ref.now += 20
    svc.heartbeat(n1, Heartbeat(launches=[LaunchReport(launch_id=launch.launch_id, state="running")]))
    svc.tick()
    assert launches_of(svc, n1)[0].desired == "run"
    svc.clock_ref.now += 11
    svc.heartbeat(n1, Heartbeat(launches=[LaunchReport(launch_id=launch.launch_id, state="running")]))
    svc.tick()
    (stopping,) = launches_of(svc, n1)
    assert stopping.desired == "stop" and "no progress for 30 s" in stopping.stop_reason
    svc.launch_status(launch.launch_id, LaunchStatus(state="exited", succeeded=False, stopped=True,
                                                     ranks=[RankExit(rank=0, signal=9)]))
    info = svc.get_job(job.id)
    assert info.state == JobState.RESTARTING and info.restarts == 1
    assert "no progress" in info.restart_reasons[0].reason


def test_lost_node_restart_is_not_counted(svc):
    n1 = add_node(svc, "a")
    job, _ = running_job(svc, n1, max_restarts=0)
    n2 = add_node(svc, "b")
    lose_node(svc, n2)
    svc.tick()
    info = svc.get_job(job.id)
    assert info.state == JobState.RESTARTING and info.restarts == 0
    assert launches_of(svc, n2)[0].attempt == 2


def test_queue_view_orders_waiting_jobs_with_reasons(svc):
    add_node(svc, "a", cpus=2)
    first = svc.submit(spec(workers=2), None, "u1")
    second = svc.submit(spec(workers=2), None, "u2")
    high = svc.submit(spec(workers=2, priority=5), None, "u3")
    svc.tick()
    assert svc.get_job(high.id).state == JobState.SCHEDULED  # priority first
    view = svc.queue_view()
    assert [r["id"] for r in view] == [first.id, second.id]
    assert [r["position"] for r in view] == [1, 2] and all(r["reason"] for r in view)
    assert svc.get_job(first.id).state == JobState.QUEUED  # the view changed nothing


# ------------------------------------------------------------ quotas, accelerators, max runtime

from torchrelay.errors import InvalidSpec  # noqa: E402
from torchrelay.scheduler import Quota  # noqa: E402
from torchrelay.server.quotas import QuotaTable  # noqa: E402


@pytest.fixture
def quota_svc(tmp_path):
    clock = Clock()
    quotas = QuotaTable.parse({"default": {"jobs": 1}, "alice": {"cpus": 2}})
    service = ClusterService(f"sqlite:///{tmp_path / 'state.db'}", str(tmp_path / "store"),
                             heartbeat_timeout_s=10, clock=clock, quotas=quotas)
    service.clock_ref = clock
    yield service
    service.stop()


def test_job_over_quota_waits_with_reason_quota_then_starts(quota_svc):
    svc = quota_svc
    add_node(svc, "a", cpus=8)
    bob1 = svc.submit(spec(workers=1), None, "bob")  # default quota: 1 job
    bob2 = svc.submit(spec(workers=1), None, "bob")
    alice1 = svc.submit(spec(workers=2), None, "alice")  # alice: 2 cpus, no job limit
    alice2 = svc.submit(spec(workers=1), None, "alice")
    svc.tick()
    states = {j: svc.get_job(j).state for j in (bob1.id, bob2.id, alice1.id, alice2.id)}
    assert states == {bob1.id: JobState.SCHEDULED, bob2.id: JobState.QUEUED,
                      alice1.id: JobState.SCHEDULED, alice2.id: JobState.QUEUED}
    assert svc.get_job(bob2.id).waiting_reason.startswith("quota")
    assert "jobs" in svc.get_job(bob2.id).waiting_reason
    assert svc.get_job(alice2.id).waiting_reason.startswith("quota")
    assert "cpus" in svc.get_job(alice2.id).waiting_reason
    (launch,) = [x for x in launches_of(svc, svc.list_nodes()[0].id) if x.job_id == bob1.id]
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    exit_launch(svc, launch.launch_id)
    svc.tick()
    assert svc.get_job(bob2.id).state == JobState.SCHEDULED  # bob's first job ended: room in his quota


@pytest.mark.parametrize("data, fragment", [
    ([1, 2], "expected a mapping"),
    ({"bob": 3}, "bob: expected {cpus, gpus, jobs}"),
    ({"bob": {"cpu": 3}}, "unknown key 'cpu'"),
    ({"bob": {"jobs": 1.5}}, "bob.jobs: 1.5 is not a whole number"),
    ({"bob": {"cpus": -1}}, "bob.cpus: -1 is not a number >= 0"),
    ({"bob": {"gpus": True}}, "bob.gpus: True"),
])
def test_quota_table_refuses_malformed_entries(data, fragment):
    with pytest.raises(InvalidSpec, match=fragment.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")):
        QuotaTable.parse(data)


def test_quota_table_default_and_file(tmp_path):
    path = tmp_path / "quotas.yaml"
    path.write_text("default: {gpus: 1}\nalice: {cpus: 4, jobs: 2}\n")
    table = QuotaTable.load(path)
    assert table.for_users(["zed", "alice", "alice"]) == (("alice", Quota(cpus=4.0, jobs=2)), ("zed", Quota(gpus=1)))
    assert QuotaTable.parse({"alice": {"jobs": 1}}).for_users(["bob"]) == ()
    with pytest.raises(InvalidSpec, match="cannot be read"):
        QuotaTable.load(tmp_path / "missing.yaml")


def test_accelerator_prefer_runs_on_cpus_when_gpus_are_taken(svc):
    cpu = add_node(svc, "cpu", cpus=4)
    gpu = svc.register(NodeRegistration(name="gpu", address="127.0.0.1", cpus=4, gpus=1, gpu_type="a100",
                                        memory=8 * 2**30)).node_id
    needs_gpu = svc.submit(spec(workers=1, resources={"gpu": 1}), None, "u")
    flexible = svc.submit(spec(workers=1, resources={"accelerator": "prefer"}), None, "u")
    svc.tick()
    (on_gpu,) = launches_of(svc, gpu)
    assert on_gpu.job_id == needs_gpu.id
    assert on_gpu.env["RELAY_ACCELERATOR"] == "gpu" and on_gpu.env["RELAY_GPU_TYPE"] == "a100"
    (on_cpu,) = launches_of(svc, cpu)
    assert on_cpu.job_id == flexible.id  # the only GPU was taken: "prefer" falls back to CPUs
    assert on_cpu.env["RELAY_ACCELERATOR"] == "cpu" and on_cpu.env["RELAY_GPUS_PER_WORKER"] == "0"
    assert any("on CPUs" in e.message for e in svc.get_job(flexible.id).events)
    used = {n.name: n.used_gpus for n in svc.list_nodes()}
    assert used == {"cpu": 0, "gpu": 1}


def test_accelerator_prefer_takes_a_free_gpu(svc):
    add_node(svc, "cpu", cpus=4)
    gpu = svc.register(NodeRegistration(name="gpu", address="127.0.0.1", cpus=4, gpus=2, memory=8 * 2**30)).node_id
    job = svc.submit(spec(workers=2, resources={"accelerator": "prefer"}), None, "u")
    svc.tick()
    (launch,) = launches_of(svc, gpu)
    assert launch.job_id == job.id and launch.env["RELAY_ACCELERATOR"] == "gpu"
    assert launch.env["RELAY_GPUS_PER_WORKER"] == "1"


@pytest.mark.parametrize("resources, fragment", [
    ({"accelerator": "none", "gpu": 1}, "accelerator 'none' with gpu=1"),
    ({"accelerator": "sometimes"}, "resources.accelerator"),
])
def test_bad_accelerator_requests_are_refused(svc, resources, fragment):
    with pytest.raises(InvalidSpec, match=fragment):
        svc.submit(spec(workers=1, resources=resources), None, "u")


def test_job_past_max_runtime_is_stopped_and_failed_not_restarted(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1, max_runtime_s=30, max_restarts=3), None, "u")
    svc.tick()
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    svc.clock_ref.now += 29
    svc.touch(n1)
    svc.tick()
    assert launches_of(svc, n1)[0].desired == "run"
    svc.clock_ref.now += 2
    svc.touch(n1)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    assert launch.desired == "stop" and "max_runtime_s=30" in launch.stop_reason
    assert svc.get_job(job.id).state == JobState.RUNNING  # until its workers have stopped
    # the worker handles SIGTERM and exits 0: still a job that ran out of time
    svc.launch_status(launch.launch_id, LaunchStatus(state="exited", succeeded=True, stopped=True))
    info = svc.get_job(job.id)
    assert info.state == JobState.FAILED and info.restarts == 0
    assert "max_runtime_s=30" in info.failure.reason and "max_runtime_s=30" in info.events[-1].message


def test_max_runtime_counts_from_placement_after_a_server_restart(tmp_path, db_url):
    clock = Clock()
    url, store = db_url, str(tmp_path / "store")
    a = ClusterService(url, store, clock=clock, heartbeat_timeout_s=1000)
    n1 = a.register(NodeRegistration(name="a", address="127.0.0.1", cpus=2, memory=2**30)).node_id
    job = a.submit(spec(workers=1, max_runtime_s=30), None, "u")
    a.tick()
    a.stop()
    clock.now += 20
    b = ClusterService(url, store, clock=clock, heartbeat_timeout_s=1000)
    b.tick()
    assert b.desired(n1).launches[0].desired == "run"
    clock.now += 11
    b.tick()
    assert b.desired(n1).launches[0].desired == "stop"
    b.stop()


def test_queue_view_estimates_start_from_declared_runtimes(svc):
    n1 = add_node(svc, "a", cpus=2)
    running = svc.submit(spec(workers=2, max_runtime_s=100), None, "u1")
    waiting = svc.submit(spec(workers=2), None, "u2")
    svc.tick()
    (launch,) = launches_of(svc, n1)
    assert launch.job_id == running.id
    (row,) = svc.queue_view()
    assert row["id"] == waiting.id and row["estimated_start"] == pytest.approx(svc.clock_ref.now + 100)


def test_concurrent_submits_are_each_written_once_and_errors_stay_with_their_own(svc):
    import threading

    add_node(svc, "a", cpus=2)
    results, errors = [], []

    def submit_some(i: int) -> None:
        for k in range(20):
            workers = 99 if (i, k) == (3, 7) else 1  # one submission can never fit
            try:
                results.append((f"t{i}-{k}", svc.submit(spec(workers=workers, name=f"t{i}-{k}"), None, "u")))
            except Unschedulable as exc:
                errors.append((f"t{i}-{k}", str(exc)))

    threads = [threading.Thread(target=submit_some, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [name for name, _ in errors] == ["t3-7"] and "99 workers" in errors[0][1]
    assert len(results) == 119 and len({info.id for _, info in results}) == 119
    for name, info in results:
        stored = svc.get_job(info.id)
        assert stored.name == name == info.name and stored.state == JobState.QUEUED
        assert [e.message for e in stored.events] == ["submitted"]
    assert len(svc.list_jobs(limit=10000)) == 119  # and no row beside them


def test_a_rank_that_never_ran_is_explained_by_the_launch_message(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    svc.launch_status(launch.launch_id, LaunchStatus(
        state="exited", succeeded=False, ranks=[RankExit(rank=0)],
        message="rank 0 never ran; torchrun exited with 1: RendezvousTimeoutError"))
    failure = svc.get_job(job.id).failure
    assert failure.rank == 0 and failure.reason.startswith("rank 0 did not run: ")
    assert "RendezvousTimeoutError" in failure.reason


@pytest.mark.parametrize("checkpoint, grace", [(True, 12.0), (False, 0.0)])
def test_cancel_gives_the_stop_grace_unless_no_checkpoint(svc, checkpoint, grace):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1, stop_grace_s=12), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    assert launch.stop_grace_s == 12.0
    svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    svc.cancel(job.id, checkpoint=checkpoint)
    (stopping,) = launches_of(svc, n1)
    assert stopping.desired == "stop" and stopping.stop_grace_s == grace


def test_async_submits_share_commits_and_each_gets_its_own_row_and_error(svc):
    import asyncio

    from sqlalchemy import event

    add_node(svc, "a", cpus=2)
    job_inserts = []
    event.listen(svc.engine, "before_cursor_execute",
                 lambda conn, cur, statement, *a: job_inserts.append(1) if statement.startswith("INSERT INTO jobs") else None)

    async def one(i: int):
        try:
            return await svc.submit_async(spec(workers=99 if i == 17 else 1, name=f"j{i}"), None, "u")
        except Unschedulable as exc:
            return exc

    async def main():
        return await asyncio.gather(*(one(i) for i in range(60)))

    results = asyncio.run(main())
    assert isinstance(results[17], Unschedulable) and "99 workers" in str(results[17])
    infos = [r for i, r in enumerate(results) if i != 17]
    assert len({info.id for info in infos}) == 59
    for i, info in enumerate(results):
        if i == 17:
            continue
        stored = svc.get_job(info.id)  # the id handed back names the row holding this request's spec
        assert stored.name == info.name == f"j{i}" and stored.state == JobState.QUEUED
        assert [e.message for e in stored.events] == ["submitted"]
    assert len(job_inserts) < 59  # batched: one multi-row INSERT per group of waiting requests
    assert len(svc.list_jobs(limit=10000)) == 59


def test_job_list_shows_placements_like_a_single_job(svc):
    add_node(svc, "a", cpus=1)
    add_node(svc, "b", cpus=1)
    wide = svc.submit(spec(workers=2, name="wide"), None, None)
    svc.tick()
    waiting = svc.submit(spec(workers=1, name="waits"), None, None)
    svc.tick()
    listed = {info.id: info for info in svc.list_jobs()}  # placements read for the page at once
    assert sorted(p.node_name for p in listed[wide.id].placement) == ["a", "b"]
    assert listed[waiting.id].placement == [] and listed[waiting.id].state == JobState.QUEUED
    for job_id, info in listed.items():
        assert info.placement == svc.get_job(job_id).placement


def test_a_restart_fences_the_checkpoints_of_the_replaced_attempt(svc, tmp_path):
    import torch

    from torchrelay.errors import StaleAttempt
    from torchrelay.storage import ArtifactStore
    from torchrelay.train.checkpoint import CheckpointStore

    n1 = add_node(svc, "a")
    job, _ = running_job(svc, n1)
    fence = ArtifactStore.attempt_key(job.id)
    assert not svc.store.exists(fence)  # a first attempt has nothing older to fence off
    n2 = add_node(svc, "b")
    lose_node(svc, n2)
    svc.tick()
    assert launches_of(svc, n2)[0].attempt == 2
    assert svc.store.get_bytes(fence) == b"2"
    # the orphan on the partitioned node "a" (attempt 1) can no longer commit; attempt 2 can
    with pytest.raises(StaleAttempt):
        CheckpointStore(svc.store, job.id, attempt=1).save({"x": torch.ones(1)}, 7)
    CheckpointStore(svc.store, job.id, attempt=2).save({"x": torch.ones(1)}, 3)


def _events(svc, job_id):
    return [(e.state, e.message) for e in svc.get_job(job_id).events]


def test_statuses_in_a_heartbeat_move_the_job_and_a_resend_changes_nothing(svc):
    n1 = add_node(svc, "a")
    job = svc.submit(spec(workers=1), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    lid = launch.launch_id
    ranks = [RankExit(rank=0, exit_code=0, returned=True)]
    beat = Heartbeat(launches=[LaunchReport(launch_id=lid, state="exited")], statuses=[
        LaunchStatusReport(launch_id=lid, status=LaunchStatus(state="running", master_port=4100)),
        LaunchStatusReport(launch_id=lid, status=LaunchStatus(state="exited", succeeded=True, ranks=ranks))])
    reply = svc.heartbeat(n1, beat)
    assert reply.statuses_taken == 2
    assert reply.launches == []  # the exited launch is no longer desired, in this very reply
    info = svc.get_job(job.id)
    assert info.state == JobState.SUCCEEDED
    assert [e.state for e in info.events] == [JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING,
                                              JobState.SUCCEEDED]
    before = _events(svc, job.id)
    again = svc.heartbeat(n1, beat)  # the reply was lost: the agent sends the same statuses again
    assert again.statuses_taken == 2 and again.launches == []
    assert _events(svc, job.id) == before and svc.get_job(job.id).state == JobState.SUCCEEDED


def test_a_resent_status_never_moves_a_launch_back(svc):
    n1 = add_node(svc, "a")
    job, launch = running_job(svc, n1)
    lid = launch.launch_id
    svc.heartbeat(n1, Heartbeat(launches=[LaunchReport(launch_id=lid, state="running")],
                                statuses=[LaunchStatusReport(launch_id=lid, status=LaunchStatus(state="preparing"))]))
    svc.launch_status(lid, LaunchStatus(state="preparing"))  # the old endpoint: the same rule
    with svc.db.read() as rows:
        assert rows.launch(lid).state == LaunchState.RUNNING
    assert svc.get_job(job.id).state == JobState.RUNNING
    exit_launch(svc, lid)
    assert svc.get_job(job.id).state == JobState.SUCCEEDED


def test_heartbeat_statuses_of_unknown_or_foreign_launches_are_skipped(svc):
    n1, n2 = add_node(svc, "a"), add_node(svc, "b", cpus=1)
    job = svc.submit(spec(workers=1, resources={"cpu": 2}), None, None)
    svc.tick()
    (launch,) = launches_of(svc, n1)
    foreign = LaunchStatusReport(launch_id=launch.launch_id, status=LaunchStatus(state="exited", succeeded=False))
    unknown = LaunchStatusReport(launch_id="job-99-a1-n0", status=LaunchStatus(state="running"))
    reply = svc.heartbeat(n2, Heartbeat(statuses=[unknown, foreign]))
    assert reply.statuses_taken == 2 and reply.launches == []
    assert svc.get_job(job.id).state == JobState.SCHEDULED  # n2 cannot speak for n1's launch
    with pytest.raises(NotFound):
        svc.launch_status("job-99-a1-n0", LaunchStatus(state="running"))  # the old endpoint still refuses it


# ---------------------------------------------------------------- parameter servers as their own role

GiB = 2**30


def test_ps_servers_take_cpu_nodes_and_no_gpu(svc):
    gpu = svc.register(NodeRegistration(name="g", address="127.0.0.1", cpus=8, gpus=4, gpu_type="a100",
                                        memory=64 * GiB)).node_id
    cpu = svc.register(NodeRegistration(name="c", address="127.0.0.1", cpus=8, memory=32 * GiB)).node_id
    job = svc.submit(spec(workers=4, resources={"cpu": 1, "gpu": 1},
                          strategy={"kind": "parameter_server", "servers": 2,
                                    "server_resources": {"cpu": 2, "memory": "4GiB"}}), None, "alice")
    svc.tick()
    (w,) = launches_of(svc, gpu)
    (sv,) = launches_of(svc, cpu)
    assert (w.node_rank, w.nproc_per_node, w.rank_offset, w.world_size, w.nnodes) == (0, 4, 0, 6, 2)
    assert (sv.node_rank, sv.nproc_per_node, sv.rank_offset, sv.world_size) == (1, 2, 4, 6)
    assert w.env["RELAY_ACCELERATOR"] == "gpu" and sv.env["RELAY_ACCELERATOR"] == "cpu"
    assert sv.env["RELAY_GPUS_PER_WORKER"] == "0"
    info = svc.get_job(job.id)
    assert "servers on c×2" in info.events[-1].message, info.events[-1].message
    # the policy sees it back as workers + servers: a second 4-gpu job waits for gpus, a cpu job
    # that needs 6 of c's cpus waits (servers hold 4), one needing 4 starts
    nxt = svc.submit(spec(workers=1, resources={"cpu": 1, "gpu": 1}), None, "bob")
    big = svc.submit(spec(workers=1, resources={"cpu": 6}, labels={}), None, "bob")
    svc.tick()
    assert svc.get_job(nxt.id).state == JobState.QUEUED
    assert svc.get_job(big.id).state == JobState.QUEUED
    for launch in (w, sv):
        svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    assert svc.get_job(job.id).state == JobState.RUNNING
    for launch in (w, sv):
        exit_launch(svc, launch.launch_id)
    assert svc.get_job(job.id).state == JobState.SUCCEEDED


def test_ps_servers_next_to_workers_on_one_node_get_their_own_launch(svc):
    node = svc.register(NodeRegistration(name="a", address="127.0.0.1", cpus=8, memory=32 * GiB)).node_id
    svc.submit(spec(workers=2, resources={"cpu": 1}, strategy={"kind": "parameter_server", "servers": 1}), None, None)
    svc.tick()
    launches = sorted(launches_of(svc, node), key=lambda x: x.node_rank)
    assert [(x.node_rank, x.nproc_per_node, x.rank_offset, x.world_size, x.nnodes) for x in launches] == \
        [(0, 2, 0, 3, 2), (1, 1, 2, 3, 2)]


def test_ps_job_whose_servers_never_fit_is_refused_naming_them(svc):
    svc.register(NodeRegistration(name="a", address="127.0.0.1", cpus=2, memory=32 * GiB))
    with pytest.raises(Unschedulable, match="1 servers"):
        svc.submit(spec(workers=2, strategy={"kind": "parameter_server", "servers": 1}), None, None)


def test_servers_still_running_after_the_workers_exited_hold_their_node(svc):
    node = svc.register(NodeRegistration(name="a", address="127.0.0.1", cpus=4, memory=32 * GiB)).node_id
    svc.submit(spec(workers=2, resources={"cpu": 1}, strategy={"kind": "parameter_server", "servers": 1,
                                                              "server_resources": {"cpu": 2}}), None, None)
    svc.tick()
    w, sv = sorted(launches_of(svc, node), key=lambda x: x.node_rank)
    for launch in (w, sv):
        svc.launch_status(launch.launch_id, LaunchStatus(state="running"))
    exit_launch(svc, w.launch_id)
    other = svc.submit(spec(workers=1, resources={"cpu": 3}), None, None)
    svc.tick()
    assert svc.get_job(other.id).state == JobState.QUEUED  # the server still holds 2 of 4 cpus


def test_a_node_lost_in_a_tick_gets_nothing_in_that_tick(svc):
    nodes = [add_node(svc, "a", cpus=1), add_node(svc, "b", cpus=1)]
    first = svc.submit(spec(workers=1, max_restarts=1), None, None)
    second = svc.submit(spec(workers=1), None, None)
    svc.tick()
    where = {launches_of(svc, n)[0].job_id: (n, launches_of(svc, n)[0].launch_id) for n in nodes}
    (lost, _), (kept, kept_launch) = where[first.id], where[second.id]
    for node, launch_id in where.values():
        svc.launch_status(launch_id, LaunchStatus(state="running"))
    svc.clock_ref.now += 11
    svc.heartbeat(kept, Heartbeat(launches=[LaunchReport(launch_id=kept_launch, state="running")]))
    svc.tick()  # the first job's node missed its heartbeats: its launch fails, the job restarts, the other is full
    assert svc.get_job(first.id).state == JobState.RESTARTING
    assert launches_of(svc, lost) == [] and [x.job_id for x in launches_of(svc, kept)] == [second.id]
