"""The Slurm executor on a real Slurm 22.05: munge, slurmctld and two slurmd (n1, n2) on 127.0.0.1.

The cluster (``tests/services/slurm.py``) starts once for this module. Each test runs its own
server (a ``ClusterService`` in this process, its SQLite file and store in the test's folder)
with a ``SlurmExecutor`` on the partition, polling Slurm every second; jobs run
``tests/jobs/plain/allreduce.py`` (a plain torchrun script), ``tests/jobs/ft/trainer.py``
(checkpoints, resumes, reports its steps) or ``examples/digits/train.py``, through
``sbatch``, ``srun`` and the agent's own launcher on each Slurm node.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

import chaos
from services.slurm import SlurmCluster
from torchrelay.client.bundle import pack_dir
from torchrelay.errors import ExecutorUnavailable, InvalidSpec, Unschedulable
from torchrelay.server.executors.slurm import SlurmConfig, SlurmExecutor
from torchrelay.server.executors.slurm_commands import SlurmCommands
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[2]
PLAIN, FT, DIGITS = REPO / "tests" / "jobs" / "plain", REPO / "tests" / "jobs" / "ft", REPO / "examples" / "digits"
INTERVAL = 5  # the trainer's checkpoint.every_steps


@pytest.fixture(scope="module")
def slurm():
    reason = SlurmCluster.unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster()
    yield cluster
    cluster.stop()


@dataclass
class Relay:
    """One test's server with its Slurm executor."""

    service: ClusterService
    executor: SlurmExecutor
    slurm: SlurmCluster

    def submit(self, workdir: Path, **spec) -> str:
        blob, digest = pack_dir(workdir)
        self.service.put_bundle(digest, blob)
        return self.service.submit({"executor": "slurm", "resources": {"cpu": 1}, **spec}, digest, None).id

    def wait(self, job_id: str, until=lambda info: info.state.terminal, timeout: float = 180, what: str = "the end"):
        deadline = time.monotonic() + timeout
        while True:
            info = self.service.get_job(job_id)
            if until(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what} of {job_id}:\n{self.describe(job_id)}")
            time.sleep(0.2)

    def describe(self, job_id: str) -> str:
        info = self.service.get_job(job_id)
        events = "\n  ".join(f"{e.state.value}: {e.message}" for e in info.events)
        logs = "\n  ".join(f"[{x.rank}] {x.text}" for x in self.service.logs(job_id).lines[-30:])
        return (f"{info.state.value} attempt {info.attempt} restarts {info.restarts} failure {info.failure}\n  "
                f"{events}\nlogs:\n  {logs}\nsqueue: {self.slurm.run('squeue', '-h', '-t', 'all', check=False).stdout}")

    def slurm_id(self, job_id: str, attempt: int | None = None) -> str:
        with self.service.db.read() as rows:
            row = rows.job(job_id)
            return rows.attempt_launches(row.seq, attempt or row.attempt)[0].external_id

    def metric_steps(self, job_id: str, attempt: int) -> list[int]:
        return [p.step for p in self.service.metrics(job_id).points
                if p.values.get("attempt") == attempt and "loss" in p.values]

    def resumed_from(self, job_id: str, attempt: int) -> set[int]:
        return {int(p.values["resumed_from"]) for p in self.service.metrics(job_id).points
                if p.values.get("attempt") == attempt and "resumed_from" in p.values}

    def wait_for_step(self, job_id: str, attempt: int, step: int) -> None:
        self.wait(job_id, lambda _: max(self.metric_steps(job_id, attempt), default=0) >= step,
                  what=f"step {step} of attempt {attempt}")


@pytest.fixture
def sbatch_args():
    return ()


@pytest.fixture
def commands():
    return None


@pytest.fixture
def relay(slurm, tmp_path, monkeypatch, sbatch_args, commands):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("RELAY_HOME", str(home))  # chaos.* find only this test's processes
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    config = SlurmConfig(partition=slurm.partition, job_root=str(home / "slurm"), python=sys.executable,
                         poll_interval_s=1.0, file_interval_s=0.2, jobcomp_path=str(slurm.jobcomp),
                         cluster_id=f"t{uuid.uuid4().hex[:6]}", sbatch_args=tuple(sbatch_args))
    executor = SlurmExecutor(config, commands)
    service = ClusterService(f"sqlite:///{home / 'state.db'}", str(home / "store"), executors=[executor])
    service.start()
    relay = Relay(service, executor, slurm)
    try:
        yield relay
    finally:
        service.stop()
        def left() -> list[str]:
            return [line.split("|")[0] for line in slurm.run("squeue", "-h", "-o", "%i|%j", check=False).stdout.split()
                    if f"|{config.cluster_id}-" in line]

        try:  # a finished job may take a moment to leave the queue (its node reports to slurmctld)
            chaos.wait_until(lambda: not left(), 60, "this test's Slurm jobs to leave the queue")
            ours = []
        except AssertionError:
            ours = left()
            slurm.run("scancel", *ours, check=False)
        jobs = [info.id for info in service.list_jobs()]
        chaos.wait_until(lambda: not any(chaos.job_pids(job) for job in jobs), 60,
                         "every process of this test's jobs to end")
        assert not ours, f"the test left Slurm jobs {ours} in the queue"


def _queue_of(relay: Relay, *slurm_ids: str) -> list[str]:
    """Those of ``slurm_ids`` still pending or running in Slurm."""
    out = relay.slurm.run("squeue", "-h", "-t", "pending,running,completing", "-o", "%i", check=False).stdout.split()
    return [i for i in slurm_ids if i in out]


# ---------------------------------------------------------------- submission


def test_dry_run_prints_the_batch_script_and_a_job_that_never_fits_is_refused_with_the_limits(relay):
    relay.executor.step()  # reads the partition's limits
    plan = relay.service.dryrun({"entrypoint": "python allreduce.py", "executor": "slurm", "workers": 2,
                                 "nodes": 2, "workers_per_node": 1}, None)
    assert plan["executor"] == "slurm" and plan["spec"]["executor"] == "slurm"
    script = plan["submission"]
    assert "#SBATCH --partition=debug" in script and "#SBATCH --nodes=2" in script
    assert "-m torchrelay.agent.slurm_step" in script
    assert relay.service.dryrun({"entrypoint": "python x.py"}, None)["submission"] is None
    het = relay.service.dryrun({"entrypoint": "python t.py", "executor": "slurm", "workers": 2, "strategy": {
        "kind": "parameter_server", "servers": 1, "server_resources": {"cpu": 3}}}, None)["submission"]
    assert "#SBATCH hetjob" in het and "#SBATCH --cpus-per-task=3" in het
    assert "srun --het-group=0 " in het and "srun --het-group=1 " in het

    with pytest.raises(Unschedulable) as err:
        relay.submit(PLAIN, entrypoint="python allreduce.py", workers=3, nodes=3, workers_per_node=1)
    assert "partition 'debug' has 2 node(s) (cpus=64, gpus=0, memory=16000MB)" in str(err.value)
    with pytest.raises(Unschedulable, match="gpu=1"):
        relay.submit(PLAIN, entrypoint="python allreduce.py", resources={"gpu": 1})
    with pytest.raises(InvalidSpec, match="'pbs' is not one of this server's executors \\(agents, slurm\\)"):
        relay.submit(PLAIN, entrypoint="python allreduce.py", executor="pbs")
    assert relay.service.list_jobs() == []


@pytest.mark.parametrize("sbatch_args", [("--constraint=no-such-feature",)])
def test_sbatch_refusing_a_job_fails_it_with_sbatchs_own_words(relay):
    job = relay.submit(PLAIN, entrypoint="python allreduce.py")
    info = relay.wait(job)
    assert info.state == JobState.FAILED, relay.describe(job)
    assert info.failure.reason.startswith("sbatch failed: sbatch: error: "), info.failure
    assert "Invalid feature specification" in info.failure.reason, info.failure


class LosesTheFirstAnswer(SlurmCommands):
    """sbatch runs, and its answer is lost the first time (a timeout while slurmctld was slow)."""

    lost = 0

    def sbatch(self, script, cwd):
        slurm_id = super().sbatch(script, cwd)
        if not self.lost:
            self.lost = 1
            raise ExecutorUnavailable(f"`sbatch --parsable {script.name} …` did not answer within 30 s")
        return slurm_id


@pytest.mark.slow
@pytest.mark.parametrize("commands", [LosesTheFirstAnswer()])
def test_a_submission_whose_answer_was_lost_is_found_not_submitted_twice(relay):
    job = relay.submit(PLAIN, entrypoint="python allreduce.py", workers=2, nodes=2, workers_per_node=1)
    info = relay.wait(job)
    assert info.state == JobState.SUCCEEDED, relay.describe(job)
    assert relay.executor.commands.lost == 1 and relay.executor.commands.calls["sbatch"] == 1
    name = relay.executor.config.slurm_name(job, 1)
    assert relay.slurm.run("squeue", "-h", "-t", "all", "--name", name, "-o", "%i").stdout.split() == \
        [relay.slurm_id(job)]
    assert any("found in Slurm's queue, not submitted again" in e.message for e in info.events), info.events


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_digits_on_two_slurm_nodes_reaches_095_with_logs_like_an_agents(relay):
    job = relay.submit(DIGITS, entrypoint="python train.py --epochs 8", workers=2, nodes=2, workers_per_node=1,
                       checkpoint={"every_steps": 50, "keep": 2})
    info = relay.wait(job, timeout=280)
    assert info.state == JobState.SUCCEEDED, relay.describe(job)
    assert [p.node_name for p in info.placement] == ["slurm:debug", "slurm:debug"]
    lines = relay.service.logs(job).lines
    accuracy = [float(m.group(1)) for x in lines if (m := re.match(r"test_accuracy=([0-9.]+)$", x.text))]
    assert accuracy and accuracy[0] >= 0.95, relay.describe(job)
    points = relay.service.metrics(job).points
    assert {p.rank for p in points} == {0, 1}
    assert [p.values["accuracy"] for p in points if "accuracy" in p.values] == [pytest.approx(accuracy[0], abs=1e-3)]
    node_dirs = sorted(p.name for p in (Path(relay.executor.config.attempt_dir(job, 1))).glob("node-*"))
    assert node_dirs == ["node-0", "node-1"]  # one launch per Slurm node, each with its rank logs
    assert (Path(relay.executor.config.attempt_dir(job, 1)) / "node-1" / "logs" / "rank-1.log").exists()


@pytest.mark.slow
def test_a_parameter_server_job_places_its_roles_as_two_components_of_a_heterogeneous_job(relay):
    job = relay.submit(DIGITS, entrypoint="python train.py --epochs 3 --batch-size 32", workers=2,
                       strategy={"kind": "parameter_server", "servers": 1, "mode": "sync",
                                 "optimizer": {"name": "adam", "lr": 0.003}, "server_resources": {"cpu": 3}})
    relay.wait(job, lambda info: info.state == JobState.RUNNING, what="RUNNING")
    slurm_id = relay.slurm_id(job)
    listed = relay.slurm.run("squeue", "-h", "-j", slurm_id, "-o", "%i|%C", check=False).stdout.split()
    assert sorted(listed) == [f"{slurm_id}+0|2", f"{slurm_id}+1|3"], listed  # each component its own shape
    info = relay.wait(job, timeout=280)
    assert info.state == JobState.SUCCEEDED, relay.describe(job)
    assert [p.workers for p in info.placement] == [2, 1]  # the workers' node, then the server's
    attempt_dir = Path(relay.executor.config.attempt_dir(job, 1))
    assert "#SBATCH hetjob" in (attempt_dir / "job.sbatch").read_text()
    assert (attempt_dir / "node-1" / "logs" / "rank-2.log").exists()  # the server: rank 2, in the second component
    accuracy = [float(m.group(1)) for x in relay.service.logs(job).lines
                if (m := re.match(r"test_accuracy=([0-9.]+)$", x.text))]
    assert accuracy and accuracy[0] >= 0.9, relay.describe(job)


def test_a_failing_rank_fails_the_job_with_its_exit_code_and_last_lines(relay):
    job = relay.submit(PLAIN, entrypoint="python allreduce.py fail", workers=2, nodes=2, workers_per_node=1,
                       stop_grace_s=3)
    info = relay.wait(job)
    assert info.state == JobState.FAILED, relay.describe(job)
    failure = info.failure
    assert (failure.rank, failure.exit_code) == (1, 3), failure
    assert "about to fail with code 3" in failure.last_lines, failure
    assert failure.reason == "rank 1 exited with code 3"
    texts = {x.text for x in relay.service.logs(job).lines}
    assert {"rank 0/2 sum=3", "rank 1/2 sum=3", "about to fail with code 3"} <= texts
    chaos.wait_until(lambda: _queue_of(relay, relay.slurm_id(job)) == [], 30, "the Slurm job to leave the queue")
    calls = relay.executor.commands.calls  # status calls: at most two per poll, and one sinfo at the start
    assert calls["squeue"] + calls["sacct"] + calls["sinfo"] <= 2 * relay.executor.polls + 1, (calls,
                                                                                              relay.executor.polls)


def test_relay_cancel_is_scancel_and_an_outside_scancel_is_seen_as_cancelled(relay):
    ours = relay.submit(PLAIN, entrypoint="python allreduce.py sleep", name="ours", stop_grace_s=5)
    outside = relay.submit(PLAIN, entrypoint="python allreduce.py sleep", name="outside", stop_grace_s=5)
    for job in (ours, outside):
        relay.wait(job, lambda info: info.state == JobState.RUNNING and any(
            "still working" in x.text for x in relay.service.logs(info.id).lines), what="its first lines")
    ids = relay.slurm_id(ours), relay.slurm_id(outside)
    relay.service.cancel(ours)
    relay.slurm.run("scancel", ids[1])
    for job in (ours, outside):
        info = relay.wait(job)
        assert info.state == JobState.CANCELLED, relay.describe(job)
    assert any("scancel outside torchrelay" in e.message for e in relay.service.get_job(outside).events)
    chaos.wait_until(lambda: _queue_of(relay, *ids) == [], 30, "nothing of ours left in Slurm's queue")


# ---------------------------------------------------------------- restarts


def _trainer(relay: Relay, name: str, args: str = "--sleep 0.15", **fields) -> str:
    return relay.submit(FT, name=name, entrypoint=f"python trainer.py {args}", workers=2, nodes=2,
                        workers_per_node=1, checkpoint={"every_steps": INTERVAL, "keep": 2}, max_restarts=2,
                        stop_grace_s=20, **fields)


@pytest.mark.slow
def test_a_worker_killed_mid_run_restarts_from_its_checkpoint(relay):
    job = _trainer(relay, "killed")
    relay.wait_for_step(job, 1, 12)
    victim = chaos.worker_pids(job, rank=1, attempt=1)
    assert victim, relay.describe(job)
    assert chaos.kill(victim[1], signal.SIGKILL)
    info = relay.wait(job)
    assert info.state == JobState.SUCCEEDED, relay.describe(job)
    assert (info.attempt, info.restarts) == (2, 1)
    assert info.restart_reasons[0].signal == signal.SIGKILL and info.restart_reasons[0].rank == 1
    (resumed,) = relay.resumed_from(job, 2)
    assert resumed >= 10 and resumed % INTERVAL == 0
    assert max(relay.metric_steps(job, 1)) - resumed <= INTERVAL


@pytest.mark.slow
def test_usr1_is_checkpoint_and_stop_and_a_requeued_job_continues_without_counting_a_restart(relay):
    """``--signal=B:USR1@90`` warns a job's batch shell 90 s before its time limit: ``scancel -b -s
    USR1`` sends the same signal now. Then ``scontrol requeue`` does what a preemption with
    requeue does (every process of the job gets SIGTERM, SIGKILL after KillWait, and the job
    waits in the queue again): the executor adopts the requeued Slurm job as the next attempt."""
    job = _trainer(relay, "warned", "--sleep 0.2 --epochs 3")
    relay.wait_for_step(job, 1, 8)
    relay.slurm.run("scancel", "-b", "-s", "USR1", relay.slurm_id(job, 1))
    relay.wait(job, lambda info: info.attempt == 2 and info.state == JobState.RUNNING, what="attempt 2")
    relay.wait_for_step(job, 2, max(relay.metric_steps(job, 1)) + 8)
    relay.slurm.run("scontrol", "requeue", relay.slurm_id(job, 2))
    _skip_the_requeue_hold(relay, relay.slurm_id(job, 2))
    info = relay.wait(job)
    assert info.state == JobState.SUCCEEDED, relay.describe(job)
    assert (info.attempt, info.restarts) == (3, 0), relay.describe(job)
    # the requeued Slurm job is adopted as attempt 3: the same Slurm job, no other sbatch
    assert relay.slurm_id(job, 3) == relay.slurm_id(job, 2) != relay.slurm_id(job, 1)
    assert relay.executor.commands.calls["sbatch"] == 2, relay.describe(job)
    # the launchers stopped their workers, which checkpointed the step they were on: all of it reported
    (resumed,) = relay.resumed_from(job, 2)
    assert resumed == max(relay.metric_steps(job, 1)), relay.describe(job)
    # a requeue signals the job's processes itself: their last steps may not have reached the server
    (resumed,) = relay.resumed_from(job, 3)
    assert max(relay.metric_steps(job, 2)) - INTERVAL <= resumed, relay.describe(job)
    messages = [e.message for e in info.events]
    assert any("SIGUSR1" in m for m in messages) and any("requeued" in m for m in messages), messages
    assert any("adopted as attempt 3" in m for m in messages), messages


def test_a_requeued_slurm_job_its_job_was_cancelled_before_adopting_is_cancelled_too(relay):
    """The executor's loop is stopped and stepped by hand, so that the job is cancelled between
    the step that saw Slurm's requeue and the one that would have adopted the Slurm job."""
    job = relay.submit(PLAIN, entrypoint="python allreduce.py sleep", stop_grace_s=5)
    relay.wait(job, lambda info: info.state == JobState.RUNNING, what="RUNNING")
    slurm_id = relay.slurm_id(job)
    relay.executor.stop()
    relay.slurm.run("scontrol", "requeue", slurm_id)
    deadline = time.monotonic() + 60
    while relay.service.get_job(job).state != JobState.QUEUED:  # the requeue seen: the attempt ended, not adopted
        assert time.monotonic() < deadline, relay.describe(job)
        relay.executor.step(poll=True)
        time.sleep(0.5)
    assert (Path(relay.executor.config.attempt_dir(job, 1)) / "requeued.json").exists()
    assert relay.service.cancel(job).state == JobState.CANCELLED
    relay.executor.step()
    chaos.wait_until(lambda: _queue_of(relay, slurm_id) == [], 30, "the requeued Slurm job to be cancelled")
    assert relay.executor.commands.calls["sbatch"] == 1 and relay.service.get_job(job).attempt == 1


def _skip_the_requeue_hold(relay: Relay, slurm_id: str) -> None:
    """Slurm 22.05 makes a requeued job wait 121 s (Reason=BeginTime, EligibleTime = requeue +
    121 s) before it may start again; an administrator's ``scontrol update StartTime=now``
    lifts that hold, so that the test does not wait for it."""
    def pending() -> bool:
        out = relay.slurm.run("squeue", "-h", "-j", slurm_id, "-o", "%T", check=False).stdout.split()
        return bool(out) and all(state == "PENDING" for state in out)

    chaos.wait_until(pending, 60, "the requeued job to wait in the queue")
    relay.slurm.run("scontrol", "update", f"JobId={slurm_id}", "StartTime=now")


@pytest.mark.slow
def test_an_unreachable_slurmctld_keeps_jobs_in_their_state_with_a_node_event(relay):
    job = _trainer(relay, "steady", "--sleep 1.0")
    relay.wait_for_step(job, 1, 2)
    relay.slurm.stop_controller()
    try:
        chaos.wait_until(lambda: _partition_node(relay).state == "DRAINING", 60, "the node to say Slurm is down")
        assert "Slurm unreachable" in _partition_node(relay).note
        polls = relay.executor.polls
        chaos.wait_until(lambda: relay.executor.polls >= polls + 1, 60, "one more status poll")
        assert relay.service.get_job(job).state == JobState.RUNNING, relay.describe(job)
    finally:
        relay.slurm.start_controller()
    info = relay.wait(job)
    assert info.state == JobState.SUCCEEDED and info.restarts == 0, relay.describe(job)
    chaos.wait_until(lambda: _partition_node(relay).state == "READY", 60, "the node to say Slurm is back")
    assert "answers again" in _partition_node(relay).note


def _partition_node(relay: Relay):
    (node,) = [n for n in relay.service.list_nodes() if n.name == "slurm:debug"]
    return node


# ---------------------------------------------------------------- one server, two executors


@pytest.mark.slow
def test_embedded_agents_and_a_slurm_partition_serve_one_server(slurm, cluster_factory, relay_home, monkeypatch,
                                                                tmp_path):
    """``relay server --slurm-partition``, as ``relay up`` starts it, with one agent beside it:
    an agents job and a Slurm job at once; ``relay submit --dry-run`` prints the batch script."""
    import subprocess

    from torchrelay.client.sdk import RelayClient

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    cluster = cluster_factory(1, server_args=["--slurm-partition", slurm.partition, "--slurm-poll", "1",
                                              "--slurm-jobcomp", str(slurm.jobcomp)])
    with RelayClient(cluster.address) as c:
        nodes = {n.name: n for n in c.nodes()}
        chaos.wait_until(lambda: "slurm:debug" in {n.name for n in c.nodes()}, 30, "the partition's node")
        spec = {"name": "mixed", "entrypoint": "python allreduce.py", "workers": 2, "resources": {"cpu": 1}}
        on_agents = c.submit(spec, base_dir=PLAIN)
        on_slurm = c.submit({**spec, "executor": "slurm", "nodes": 2, "workers_per_node": 1}, base_dir=PLAIN)
        final = {job.id: c.wait(job.id, timeout=180, poll_s=0.5) for job in (on_agents, on_slurm)}
        for job_id, info in final.items():
            assert info.state == JobState.SUCCEEDED, (job_id, info.events, info.failure)
            assert {x.text for x in c.logs(job_id).lines} >= {"rank 0/2 sum=3", "rank 1/2 sum=3"}
        assert {p.node_name for p in final[on_slurm.id].placement} == {"slurm:debug"}
        assert "slurm:debug" not in {p.node_name for p in final[on_agents.id].placement}
        assert len(nodes) >= 1

    job_file = tmp_path / "job.yaml"
    job_file.write_text("entrypoint: python allreduce.py\nexecutor: slurm\nnodes: 2\nworkers_per_node: 1\n")
    env = {**os.environ, "RELAY_ADDRESS": cluster.address}
    done = subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", "submit", str(job_file), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "executor: slurm" in done.stdout and "#SBATCH --nodes=2" in done.stdout
    assert "-m torchrelay.agent.slurm_step" in done.stdout
