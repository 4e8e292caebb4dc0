"""A placement as launches and what each launch's workers are told; the policy's view of running jobs."""
import json
from types import SimpleNamespace

import pytest

from torchrelay import scheduler as policy
from torchrelay.layout import RankLayout
from torchrelay.server.assignment import WorkerEnvironment, launch_assignment, plan_launches
from torchrelay.server.scheduling import allocation, placement_summary, queued_job
from torchrelay.spec import JobSpec

CPU = policy.WorkerShape(cpu=1, gpu=0, memory=0, gpu_type=None, accelerator="none")
GPU = policy.WorkerShape(cpu=1, gpu=1, memory=0, gpu_type="a100", accelerator="required")
SERVER = policy.WorkerShape(cpu=2, gpu=0, memory=0, gpu_type=None, accelerator="none")
MIXED = policy.WorkerShape(cpu=1, gpu=1, memory=0, gpu_type="a100", accelerator="any")


def placement(workers, roles=(), shape=CPU):
    return policy.Placement(job_id="job-3", shape=shape, placement=tuple(workers), roles=tuple(roles))


@pytest.mark.parametrize("workers, roles, layout, expected", [
    # (node, nproc) of the workers, the roles' (name, shape, where), the layout -> (node, rank, offset, nproc)
    ([("a", 2)], (), RankLayout(workers=2), [("a", 0, 0, 2)]),
    ([("a", 2), ("b", 2)], (), RankLayout(workers=4), [("a", 0, 0, 2), ("b", 1, 2, 2)]),
    # servers after the workers, even on the same node (their own launch): ranks W..W+S-1
    ([("a", 2)], [("server", SERVER, (("a", 1),))], RankLayout(workers=2, servers=1),
     [("a", 0, 0, 2), ("a", 1, 2, 1)]),
    ([("g", 4)], [("server", SERVER, (("c", 2),))], RankLayout(workers=4, servers=2),
     [("g", 0, 0, 4), ("c", 1, 4, 2)]),
])
def test_plan_launches_follows_the_rank_layout(workers, roles, layout, expected):
    plans = plan_launches("job-3", 2, placement(workers, roles), layout)
    assert [(p.node_id, p.node_rank, p.rank_offset, p.nproc) for p in plans] == expected
    assert all(p.world_size == layout.world_size and p.nnodes == len(expected) for p in plans)
    assert [p.id for p in plans] == [f"job-3-a2-n{i}" for i in range(len(expected))]
    for plan in plans:  # every rank a launch holds is what the layout says it is
        role = {layout.is_server(r) for r in range(plan.rank_offset, plan.rank_offset + plan.nproc)}
        assert role == {plan.shape is SERVER}


def test_a_placement_that_does_not_hold_the_layout_is_refused():
    with pytest.raises(ValueError, match="layout 2 of 3"):
        plan_launches("job-3", 1, placement([("a", 2)]), RankLayout(workers=2, servers=1))


def spec(**kw):
    return JobSpec.parse({"name": "t", "entrypoint": "python train.py", **kw})


@pytest.mark.parametrize("gpus, node_gpu_type, expected", [
    (0, None, {"RELAY_ACCELERATOR": "cpu", "RELAY_GPUS_PER_WORKER": "0"}),
    (0, "a100", {"RELAY_ACCELERATOR": "cpu", "RELAY_GPUS_PER_WORKER": "0"}),  # "prefer" fell back to CPUs
    (2, "a100", {"RELAY_ACCELERATOR": "gpu", "RELAY_GPUS_PER_WORKER": "2", "RELAY_GPU_TYPE": "a100"}),
    (1, None, {"RELAY_ACCELERATOR": "gpu", "RELAY_GPUS_PER_WORKER": "1"}),
])
def test_worker_environment(gpus, node_gpu_type, expected):
    job = spec(workers=3, env={"A": "1", "RELAY_WORKERS": "overridden"}, strategy={"kind": "parameter_server"})
    base = WorkerEnvironment.of_spec(job)
    env = base.granted(gpus, node_gpu_type).variables()
    assert base.layout == RankLayout(workers=3, servers=1)
    assert env["A"] == "1" and env["RELAY_WORKERS"] == "3" and env["RELAY_JOB_NAME"] == "t"
    assert json.loads(env["RELAY_STRATEGY"])["kind"] == "parameter_server"
    assert json.loads(env["RELAY_CHECKPOINT"]) == {"every_steps": 0, "keep": 3, "async": False}
    assert {k: v for k, v in env.items() if k in ("RELAY_ACCELERATOR", "RELAY_GPUS_PER_WORKER", "RELAY_GPU_TYPE")} \
        == expected
    assert base.granted(gpus, node_gpu_type).variables(base.job_variables()) == env
    assert "RELAY_MEMORY_PER_WORKER" not in env  # no resources.memory: no limit for prepare to check


def test_worker_environment_carries_the_memory_per_worker():
    env = WorkerEnvironment.of_spec(spec(workers=2, resources={"memory": "1.5GiB"})).variables()
    assert env["RELAY_MEMORY_PER_WORKER"] == str(3 << 29)


@pytest.mark.parametrize("own_grace, master, expected_grace, expected_master", [
    (None, ("10.0.0.1", 4100), 12.0, ("10.0.0.1", 4100)),
    (0.0, (None, None), 0.0, (None, None)),
])
def test_launch_assignment(own_grace, master, expected_grace, expected_master):
    row = SimpleNamespace(id="job-3-a1-n1", job_seq=3, attempt=1, node_rank=1, nnodes=2, nproc=2, rank_offset=2,
                          world_size=4, desired="run", stop_reason=None, stop_grace_s=own_grace, bundle="ab",
                          cpu=0.5, memory=2**30)
    out = launch_assignment(row, job_id="job-3", argv=["python", "x.py"], env={"A": "1"}, spec_stop_grace_s=12.0,
                            master=master, store_url="/store")
    assert (out.stop_grace_s, out.master_addr, out.master_port) == (expected_grace, *expected_master)
    assert (out.nproc_per_node, out.rank_offset, out.world_size, out.job_store_prefix) == (2, 2, 4, "jobs/job-3")
    assert (out.cpu, out.memory) == (0.5, 2**30)  # per worker: what the agent's cgroup enforces


def live(node, nproc, offset, gpu=0, cpu=1.0):
    return SimpleNamespace(node_id=node, nproc=nproc, rank_offset=offset, cpu=cpu, gpu=gpu, memory=0)


def test_an_allocation_tells_servers_from_workers_by_the_layout():
    job = spec(workers=2, resources={"gpu": 1, "gpu_type": "a100"},
               strategy={"kind": "parameter_server", "servers": 1, "server_resources": {"cpu": 2}})
    got = allocation(seq=3, spec=job, live=[live("g", 2, 0, gpu=1), live("c", 1, 2, cpu=2)], started_at=5.0,
                     preempting=False)
    assert got.placement == (("g", 2),) and got.shape.gpu == 1 and got.shape.gpu_type == "a100"
    ((role, shape, where),) = got.roles
    assert (role, shape.cpu, shape.gpu, where) == ("server", 2, 0, (("c", 1),))
    assert (got.job_id, got.started_at) == ("job-3", 5.0)


def test_a_job_without_servers_has_no_roles():
    got = allocation(seq=1, spec=spec(workers=2), live=[live("a", 2, 0)], started_at=0.0, preempting=True)
    assert got.roles == () and got.preempting and got.placement == (("a", 2),)


def test_queued_job_is_the_specs_view():
    q = queued_job(9, spec(workers=4, nodes=2, workers_per_node=2, priority=3, user="ann", labels={"z": "b"}))
    assert (q.job_id, q.submit_seq, q.user, q.priority, q.workers_per_node, q.labels) == \
        ("job-9", 9, "ann", 3, 2, (("z", "b"),))


@pytest.mark.parametrize("place, resources, text", [
    (placement([("a", 2), ("b", 1)]), {}, "A×2, B×1"),
    (placement([("a", 2)], shape=GPU), {"gpu": 1}, "A×2 (1 a100 per worker)"),
    (placement([("a", 2)]), {"accelerator": "prefer"}, "A×2 (on CPUs: the gang did not fit on accelerators)"),
    (placement([("a", 2)], [("server", SERVER, (("b", 1),))]), {}, "A×2; servers on B×1"),
    (policy.Placement("job-1", (("a", 2), ("b", 1)), MIXED, on_cpu=("b",)), {"accelerator": "any"},
     "A×2, B×1 (1 a100 per GPU rank); CPU ranks on B"),
    (policy.Placement("job-1", (("b", 1),), MIXED, on_cpu=("b",)), {"accelerator": "any"}, "B×1; CPU ranks on B"),
])
def test_placement_summary(place, resources, text):
    names, kinds = {"a": "A", "b": "B"}, {"a": "a100", "b": None}
    assert placement_summary(place, spec(resources=resources), names, kinds) == text


# ---------------------------------------------------------------- mixed devices (accelerator "any")


def test_a_mixed_placement_grants_gpus_only_on_its_gpu_nodes():
    place = policy.Placement("job-4", (("g", 2), ("c", 1)), MIXED, on_cpu=("c",))
    plans = plan_launches("job-4", 1, place, RankLayout(workers=3))
    assert [(p.node_id, p.rank_offset, p.shape.gpu, p.shape.cpu) for p in plans] == [("g", 0, 1, 1), ("c", 2, 0, 1)]


def test_a_mixed_allocation_is_rebuilt_from_its_launches():
    job = spec(workers=3, resources={"accelerator": "any", "gpu_type": "a100"})
    got = allocation(seq=4, spec=job, live=[live("g", 2, 0, gpu=1), live("c", 1, 2)], started_at=1.0, preempting=False)
    assert got.placement == (("g", 2), ("c", 1)) and got.on_cpu == ("c",)
    assert (got.shape.gpu, got.shape.gpu_type, got.shape.accelerator) == (1, "a100", "any")
    assert [(shape.gpu, where) for shape, where in got.parts()] == [(1, (("g", 2),)), (0, (("c", 1),))]
    # all on CPU nodes (no GPU was free of the right type): still a mixed job, holding no GPU
    cpus_only = allocation(seq=4, spec=job, live=[live("c", 3, 0)], started_at=1.0, preempting=False)
    assert cpus_only.on_cpu == ("c",) and sum(s.gpu * n for s, where in cpus_only.parts() for _, n in where) == 0


def test_every_launch_of_a_mixed_job_is_told_so():
    job = spec(workers=2, resources={"accelerator": "any"})
    base = WorkerEnvironment.of_spec(job)
    assert base.granted(1, "a100").variables()["RELAY_MIXED_DEVICES"] == "1"
    assert base.granted(0, None).variables()["RELAY_MIXED_DEVICES"] == "1"
    assert "RELAY_MIXED_DEVICES" not in WorkerEnvironment.of_spec(spec(workers=2)).variables()
    assert queued_job(1, job).shape.accelerator == "any"
