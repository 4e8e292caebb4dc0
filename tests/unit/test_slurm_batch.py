"""The Slurm executor's pure half: partition limits, a job's shape, the batch script (tables of cases)."""
from __future__ import annotations

import os
import subprocess

import pytest

from torchrelay.errors import Unschedulable
from torchrelay.server.executors.slurm_batch import (NodeLimits, PartitionLimits, SlurmConfig, Submission,
                                                     parse_sinfo, parse_time_limit, render_batch_script, shape_of)
from torchrelay.spec import JobSpec

SINFO = """\
n1|64|16000|(null)|infinite|idle
n2|64|16000|gpu:a100:2(S:0-1)|infinite|mixed
n2|64|16000|gpu:a100:2(S:0-1)|infinite|mixed
"""


def test_sinfo_gives_each_node_once_with_gpus_from_gres():
    limits = parse_sinfo(SINFO, "debug")
    assert limits.nodes == (NodeLimits("n1", 64, 16000, 0, "idle"), NodeLimits("n2", 64, 16000, 2, "mixed"))
    assert limits.max_time_s is None
    assert "partition 'debug' has 2 node(s)" in limits.describe()


@pytest.mark.parametrize("text, seconds", [
    ("infinite", None), ("UNLIMITED", None), ("30", 1800.0), ("1:00:00", 3600.0), ("05:30", 330.0),
    ("2-12:00:00", 2 * 86400 + 12 * 3600.0),
])
def test_time_limits(text, seconds):
    assert parse_time_limit(text) == seconds


def _limits(nodes=2, cpus=4, gpus=0, memory_mb=8000, max_time_s=None):
    return PartitionLimits("debug", tuple(NodeLimits(f"n{i}", cpus, memory_mb, gpus, "idle") for i in range(nodes)),
                           max_time_s)


PS = {"kind": "parameter_server", "servers": 1, "server_resources": {"cpu": 2}}


@pytest.mark.parametrize("spec, limits, hetjob, expect", [
    # per group: (role, nodes, per_node, cpus per node, gpus per node, memory MB per node)
    ({"workers": 2, "nodes": 2, "workers_per_node": 1}, _limits(), True, [("workers", 2, 1, 1, 0, 0)]),
    ({"workers": 4}, _limits(cpus=4), True, [("workers", 1, 4, 4, 0, 0)]),  # fits one node: one node
    ({"workers": 4}, _limits(cpus=2), True, [("workers", 2, 2, 2, 0, 0)]),  # fewest nodes whose even share fits
    ({"workers": 2, "resources": {"cpu": 2, "memory": "1GiB"}}, _limits(cpus=2), True,
     [("workers", 2, 1, 2, 0, 1024)]),
    ({"workers": 2, "resources": {"gpu": 1}}, _limits(gpus=2), True, [("workers", 1, 2, 2, 2, 0)]),
    ({"workers": 1, "resources": {"cpu": 0.5}}, _limits(), True, [("workers", 1, 1, 1, 0, 0)]),  # at least one CPU
    # a parameter-server job: one component per role, each its own shape
    ({"workers": 2, "strategy": PS}, _limits(nodes=3, cpus=2), True,
     [("workers", 1, 2, 2, 0, 0), ("servers", 1, 1, 2, 0, 0)]),
    ({"workers": 4, "nodes": 2, "workers_per_node": 2, "resources": {"gpu": 1},
      "strategy": {**PS, "servers": 2, "server_resources": {"cpu": 4, "memory": "2GiB"}}},
     _limits(cpus=4, gpus=2, memory_mb=4096), True,
     [("workers", 2, 2, 2, 2, 0), ("servers", 2, 1, 4, 0, 2048)]),  # two servers do not fit one node
    # the fallback: one step, workers then servers, every process the larger shape
    ({"workers": 2, "strategy": PS}, _limits(nodes=3, cpus=2), False, [("all", 3, 1, 2, 0, 0)]),
    # limits not read yet: the spec's nodes, else one node per group
    ({"workers": 2, "strategy": PS}, None, True, [("workers", 1, 2, 2, 0, 0), ("servers", 1, 1, 2, 0, 0)]),
    ({"workers": 4}, None, True, [("workers", 1, 4, 4, 0, 0)]),
])
def test_shapes(spec, limits, hetjob, expect):
    shape = shape_of(JobSpec.parse({"entrypoint": "python t.py", **spec}), limits, hetjob=hetjob)
    assert [(g.role, g.nodes, g.per_node, g.cpus, g.gpus, g.memory_mb) for g in shape.groups] == expect
    assert shape.hetjob == (len(expect) > 1) and shape.world == sum(g[1] * g[2] for g in expect)


@pytest.mark.parametrize("spec, limits, words", [
    ({"workers": 3, "nodes": 3, "workers_per_node": 1}, _limits(nodes=2), ["3 node(s) × 1", "2 node(s)"]),
    ({"workers": 2, "strategy": {**PS, "server_resources": {"cpu": 8}}}, _limits(),
     ["2 worker(s) × (cpu=1", "1 server(s) × (cpu=8, gpu=0, memory=0MB), at best 1 node(s) × 1"]),
    ({"workers": 2, "resources": {"gpu": 1}}, _limits(), ["gpu=1", "cpus=4, gpus=0, memory=8000MB"]),
    ({"workers": 1, "resources": {"memory": "9GiB"}}, _limits(), ["memory=9216MB"]),
    ({"workers": 1, "resources": {"cpu": 5}}, _limits(), ["cpu=5"]),
    ({"workers": 1, "max_runtime_s": 7200}, _limits(max_time_s=3600), ["max_runtime_s=7200", "time limit 3600s"]),
])
def test_never_fits_names_the_partition_limits(spec, limits, words):
    with pytest.raises(Unschedulable) as err:
        shape_of(JobSpec.parse({"entrypoint": "python t.py", "name": "big", **spec}), limits)
    text = str(err.value)
    assert "job 'big' can never run on Slurm" in text and "partition 'debug'" in text
    for word in words:
        assert word in text, text


def test_nodes_are_the_workers_nodes_and_in_one_step_must_hold_the_servers_too():
    spec = JobSpec.parse({"entrypoint": "python t.py", "nodes": 2, "workers_per_node": 1,
                          "strategy": {"kind": "parameter_server", "servers": 1}})
    assert [(g.role, g.nodes) for g in shape_of(spec, _limits()).groups] == [("workers", 2), ("servers", 1)]
    with pytest.raises(Unschedulable, match="does not hold its 3 processes"):
        shape_of(spec, _limits(), hetjob=False)


def _config(**kw):
    return SlurmConfig(partition="gpu", job_root="/shared/relay", python="/opt/venv/bin/python", **kw)


def _options(text: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_batch_script_has_one_task_per_node_running_the_agents_launcher():
    spec = JobSpec.parse({"entrypoint": "python t.py", "workers": 4, "nodes": 2, "workers_per_node": 2,
                          "resources": {"cpu": 2, "gpu": 1, "memory": "2GiB"}, "max_runtime_s": 3000})
    limits = _limits(cpus=8, gpus=4, memory_mb=64000)
    config = _config(sbatch_args=("--account=ml",))
    text = render_batch_script(Submission(name="relay-job-7-a2", config=config, shape=shape_of(spec, limits),
                                          attempt_dir=config.attempt_dir("job-7", 2)))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    assert _options(text) == ["--job-name=relay-job-7-a2", "--output=/shared/relay/job-7/a2/slurm-%j.out",
                              "--chdir=/shared/relay/job-7/a2", "--open-mode=append", "--partition=gpu",
                              "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=4", "--gres=gpu:2", "--mem=4096M",
                              "--time=50", "--signal=B:USR1@90", "--requeue", "--account=ml"]
    assert "attempt_dir=/shared/relay/job-7/a2" in lines
    assert ('srun --ntasks-per-node=1 --kill-on-bad-exit=0 /opt/venv/bin/python -m torchrelay.agent.slurm_step '
            '"$attempt_dir" &') in lines
    assert "--het-group" not in text and "hetjob" not in text
    assert """trap 'date +%s >> "$attempt_dir/stop.request"' USR1""" in lines
    assert any(line.startswith("export RELAY_MASTER_PORT=$(/opt/venv/bin/python -c ") for line in lines)


def test_a_parameter_server_job_is_a_heterogeneous_job_one_component_and_one_srun_per_role():
    spec = JobSpec.parse({"entrypoint": "python t.py", "workers": 2, "max_runtime_s": 600,
                          "strategy": {**PS, "servers": 1, "server_resources": {"cpu": 3, "memory": "1GiB"}}})
    config = _config(sbatch_args=("--account=ml",))
    text = render_batch_script(Submission(name="relay-job-8-a1", config=config, shape=shape_of(spec, _limits()),
                                          attempt_dir="/d"))
    assert _options(text) == ["--job-name=relay-job-8-a1", "--output=/d/slurm-%j.out", "--chdir=/d",
                              "--open-mode=append", "--partition=gpu", "--nodes=1", "--ntasks-per-node=1",
                              "--cpus-per-task=2", "--time=10", "--signal=B:USR1@90", "--requeue", "--account=ml",
                              "hetjob",
                              "--partition=gpu", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=3",
                              "--mem=1024M", "--time=10", "--account=ml"]
    steps = [line for line in text.splitlines() if line.startswith("srun ")]
    assert steps == [f"srun --het-group={k} --ntasks-per-node=1 --kill-on-bad-exit=0 /opt/venv/bin/python -m "
                     f'torchrelay.agent.slurm_step "$attempt_dir" {k} &' for k in (0, 1)]
    fallback = render_batch_script(Submission(name="n", config=config, attempt_dir="/d",
                                              shape=shape_of(spec, _limits(cpus=16), hetjob=False)))
    assert "hetjob" not in fallback and "--het-group" not in fallback and "#SBATCH --cpus-per-task=9" in fallback


def test_batch_script_without_signal_or_requeue():
    spec = JobSpec.parse({"entrypoint": "python t.py"})
    config = _config(signal_s=0, requeue=False)
    text = render_batch_script(Submission(name="n", config=config, shape=shape_of(spec, _limits()),
                                          attempt_dir="/d"))
    assert "--signal" not in text and "#SBATCH --no-requeue" in text and "--time" not in text and "--mem" not in text


def _run_prologue(tmp_path, restart: str | None, named: str | None, wait_s: int = 5):
    """The script's lines up to the steps, run by bash with ``srun`` and the port pick stubbed:
    the attempt folder the steps would get."""
    base = tmp_path / "a2"
    base.mkdir()
    if named is not None:
        (base / f"requeued-{restart}").write_text(named)
    spec = JobSpec.parse({"entrypoint": "python t.py"})
    text = render_batch_script(Submission(name="n", config=_config(), shape=shape_of(spec, _limits()),
                                          attempt_dir=str(base)))
    text = text.replace("/opt/venv/bin/python -c", "true").replace("srun ", "echo ")
    text = text.replace("-ge 600", f"-ge {wait_s}")
    env = {"PATH": os.environ["PATH"], **({"SLURM_RESTART_COUNT": restart} if restart is not None else {})}
    return subprocess.run(["bash", "-c", text], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("restart, named, runs", [
    (None, None, "a2"),  # the first run: the submitting attempt's folder
    ("0", None, "a2"),
    ("1", "/shared/relay/job-7/a3", "/shared/relay/job-7/a3"),  # requeued: the attempt the server adopted it as
])
def test_a_requeued_run_runs_the_attempt_the_server_named(tmp_path, restart, named, runs):
    done = _run_prologue(tmp_path, restart, named)
    assert done.returncode == 0, done.stderr
    (step,) = [line for line in done.stdout.splitlines() if "slurm_step" in line]
    assert step.split()[-1].endswith(runs)


def test_a_requeued_run_that_no_attempt_adopts_gives_up_saying_so(tmp_path):
    done = _run_prologue(tmp_path, "2", None, wait_s=1)
    assert done.returncode == 1 and "slurm_step" not in done.stdout
    assert "no attempt named in" in done.stderr and "requeued-2" in done.stderr
