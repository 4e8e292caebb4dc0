"""The executor seam: the agents' cycle leaves another executor's jobs and node alone; a job
names an executor the server has, and that executor refuses what can never run on it."""
from __future__ import annotations

import pytest

from torchrelay.errors import InvalidSpec, Unschedulable
from torchrelay.server.executors import EXECUTOR_LABEL, Executor, executor_labels
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState
from torchrelay.wire import NodeRegistration


class SmallPool(Executor):
    """An executor that places nothing itself and takes jobs of at most ``limit`` workers."""

    def __init__(self, limit: int = 4):
        self.name, self.limit, self.kicks = "pool", limit, 0

    def check(self, spec):
        if spec.workers > self.limit:
            raise Unschedulable(f"job {spec.name!r}: pool holds {self.limit} workers, not {spec.workers}")

    def dryrun(self, spec, job_id):
        return f"would run {spec.entrypoint} on {spec.workers} of {self.limit}"

    def kick(self):
        self.kicks += 1


@pytest.fixture
def service(tmp_path):
    pool = SmallPool()
    svc = ClusterService(f"sqlite:///{tmp_path / 'state.db'}", str(tmp_path / "store"), executors=[pool])
    yield svc, pool
    svc.stop()


def _register(svc, name, labels=None):
    return svc.register(NodeRegistration(name=name, address="127.0.0.1", cpus=8, memory=8 << 30,
                                         labels=labels or {})).node_id


def test_the_agents_cycle_places_neither_another_executors_jobs_nor_on_its_node(service):
    svc, pool = service
    _register(svc, "pool:p", dict(executor_labels("pool")))
    theirs = svc.submit({"entrypoint": "python x.py", "executor": "pool", "workers": 2}, None, None).id
    ours = svc.submit({"entrypoint": "python x.py", "workers": 2}, None, None).id
    svc.tick()
    assert svc.get_job(theirs).state == JobState.QUEUED  # the pool places its own
    assert svc.get_job(ours).state == JobState.QUEUED  # the pool's node is no agent's
    agent = _register(svc, "a1")
    svc.tick()
    info = svc.get_job(ours)
    assert info.state == JobState.SCHEDULED and {p.node_id for p in info.placement} == {agent}
    assert svc.get_job(theirs).state == JobState.QUEUED
    assert pool.kicks > 0  # told of the new jobs


def test_a_job_names_an_executor_the_server_has_and_fits_it(service):
    svc, _ = service
    with pytest.raises(InvalidSpec, match="executor: 'slurm' is not one of this server's executors \\(agents, pool\\)"):
        svc.submit({"entrypoint": "python x.py", "executor": "slurm"}, None, None)
    with pytest.raises(Unschedulable, match="pool holds 4 workers, not 8"):
        svc.submit({"entrypoint": "python x.py", "executor": "pool", "workers": 8}, None, None)
    with pytest.raises(InvalidSpec, match="executor"):
        svc.submit({"entrypoint": "python x.py", "executor": "Bad Name"}, None, None)
    assert svc.list_jobs() == []


def test_a_job_of_another_executor_is_not_refused_for_the_agents_nodes(service):
    svc, _ = service
    _register(svc, "small")  # an agent node of 8 CPUs: 4 workers of 4 CPUs never fit it
    with pytest.raises(Unschedulable):
        svc.submit({"entrypoint": "python x.py", "workers": 4, "resources": {"cpu": 4}}, None, None)
    svc.submit({"entrypoint": "python x.py", "workers": 4, "resources": {"cpu": 4}, "executor": "pool"}, None, None)


def test_dry_run_shows_what_the_executor_would_submit(service):
    svc, _ = service
    plan = svc.dryrun({"entrypoint": "python x.py", "executor": "pool", "workers": 3}, None)
    assert plan == {"executor": "pool", "spec": plan["spec"], "submission": "would run python x.py on 3 of 4"}
    assert plan["spec"]["executor"] == "pool" and plan["spec"]["workers"] == 3
    assert svc.dryrun({"entrypoint": "python x.py"}, None)["submission"] is None
    assert EXECUTOR_LABEL == "torchrelay.executor"
