"""The Slurm executor's pure half: partition limits, a job's shape, the batch script (tables of cases)."""
from __future__ import annotations

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


@pytest.mark.parametrize("spec, limits, expect", [
    # (nodes, per_node, cpus per node, gpus per node, memory MB per node)
    ({"workers": 2, "nodes": 2, "workers_per_node": 1}, _limits(), (2, 1, 1, 0, 0)),
    ({"workers": 4}, _limits(cpus=4), (1, 4, 4, 0, 0)),  # fits one node: one node
    ({"workers": 4}, _limits(cpus=2), (2, 2, 2, 0, 0)),  # fewest nodes whose even share fits
    ({"workers": 2, "resources": {"cpu": 2, "memory": "1GiB"}}, _limits(cpus=2), (2, 1, 2, 0, 1024)),
    ({"workers": 2, "resources": {"gpu": 1}}, _limits(gpus=2), (1, 2, 2, 2, 0)),
    ({"workers": 1, "resources": {"cpu": 0.5}}, _limits(), (1, 1, 1, 0, 0)),  # at least one CPU
    # a parameter-server job: workers then servers, every process the larger shape
    ({"workers": 2, "strategy": {"kind": "parameter_server", "servers": 1, "server_resources": {"cpu": 2}}},
     _limits(nodes=3, cpus=2), (3, 1, 2, 0, 0)),
])
def test_shapes(spec, limits, expect):
    shape = shape_of(JobSpec.parse({"entrypoint": "python t.py", **spec}), limits)
    assert (shape.nodes, shape.per_node, shape.cpus, shape.gpus, shape.memory_mb) == expect


@pytest.mark.parametrize("spec, limits, words", [
    ({"workers": 3, "nodes": 3, "workers_per_node": 1}, _limits(nodes=2), ["3 node(s) × 1", "2 node(s)"]),
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


def test_nodes_that_do_not_hold_the_world_are_refused():
    spec = JobSpec.parse({"entrypoint": "python t.py", "nodes": 2, "workers_per_node": 1,
                          "strategy": {"kind": "parameter_server", "servers": 1}})
    with pytest.raises(Unschedulable, match="does not hold its 3 processes"):
        shape_of(spec, _limits())


def _config(**kw):
    return SlurmConfig(partition="gpu", job_root="/shared/relay", python="/opt/venv/bin/python", **kw)


def test_batch_script_has_one_task_per_node_running_the_agents_launcher():
    spec = JobSpec.parse({"entrypoint": "python t.py", "workers": 4, "nodes": 2, "workers_per_node": 2,
                          "resources": {"cpu": 2, "gpu": 1, "memory": "2GiB"}, "max_runtime_s": 3000})
    limits = _limits(cpus=8, gpus=4, memory_mb=64000)
    config = _config(sbatch_args=("--account=ml",))
    text = render_batch_script(Submission(name="relay-job-7-a2", config=config, shape=shape_of(spec, limits),
                                          attempt_dir=config.attempt_dir("job-7", 2)))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    options = [line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")]
    assert options == ["--job-name=relay-job-7-a2", "--partition=gpu", "--nodes=2", "--ntasks-per-node=1",
                       "--cpus-per-task=4", "--output=/shared/relay/job-7/a2/slurm-%j.out",
                       "--chdir=/shared/relay/job-7/a2", "--open-mode=append", "--gres=gpu:2", "--mem=4096M",
                       "--time=50", "--signal=B:USR1@90", "--requeue", "--account=ml"]
    assert ("srun --ntasks-per-node=1 --kill-on-bad-exit=0 /opt/venv/bin/python -m torchrelay.agent.slurm_step "
            "/shared/relay/job-7/a2 &") in lines
    assert "trap 'date +%s >> /shared/relay/job-7/a2/stop.request' USR1" in lines
    assert any(line.startswith("export RELAY_MASTER_PORT=$(/opt/venv/bin/python -c ") for line in lines)


def test_batch_script_without_signal_or_requeue():
    spec = JobSpec.parse({"entrypoint": "python t.py"})
    config = _config(signal_s=0, requeue=False)
    text = render_batch_script(Submission(name="n", config=config, shape=shape_of(spec, _limits()),
                                          attempt_dir="/d"))
    assert "--signal" not in text and "#SBATCH --no-requeue" in text and "--time" not in text and "--mem" not in text
