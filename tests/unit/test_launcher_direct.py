"""Pure parts of the direct launch (a world of one, no torchrun) and of the zygote's choice."""
from __future__ import annotations

import pytest

from torchrelay import wire
from torchrelay.agent.backends import BackendKind
from torchrelay.agent.commands import build_rank_env, direct_command, is_direct
from torchrelay.agent.launcher import default_backend_kind
from torchrelay.agent.target import WORKER_MODULE, TargetKind, WorkerTarget, target_of_entrypoint
from torchrelay.agent.zygote import Zygote, eligible, startup_environment

pytestmark = pytest.mark.timeout(30)


def assignment(**overrides) -> wire.LaunchAssignment:
    data = dict(launch_id="L1", job_id="J1", attempt=0, desired="run", node_rank=0, nnodes=1,
                nproc_per_node=1, world_size=1, rank_offset=0, entrypoint=["python", "-c", "pass"],
                bundle=None, store_url="/tmp/store", job_store_prefix="jobs/J1")
    data.update(overrides)
    return wire.LaunchAssignment(**data)


@pytest.mark.parametrize("nnodes, nproc, world, direct", [
    (1, 1, 1, True),
    (1, 2, 2, False),   # two workers on one node: torchrun
    (2, 1, 2, False),   # one worker on each of two nodes: torchrun (rendezvous across nodes)
])
def test_is_direct_only_for_a_world_of_one(nnodes, nproc, world, direct):
    assert is_direct(assignment(nnodes=nnodes, nproc_per_node=nproc, world_size=world)) is direct


@pytest.mark.parametrize("nproc, world, with_zygote, with_warm, kind", [
    (2, 2, True, False, BackendKind.TORCHRUN),
    (2, 2, True, True, BackendKind.WARM),
    (1, 1, True, True, BackendKind.ZYGOTE),
    (1, 1, False, False, BackendKind.DIRECT),
])
def test_default_backend(nproc, world, with_zygote, with_warm, kind):
    zygote = Zygote(python="/py") if with_zygote else None  # never started: nothing spawned
    warm = Zygote(python="/py", preload=("torch",)) if with_warm else None
    assert default_backend_kind(assignment(nproc_per_node=nproc, world_size=world), zygote, warm) is kind


def test_rank_env_is_what_torchrun_gives_a_single_worker():
    env = build_rank_env(assignment(), master_addr="10.0.0.5", master_port=29511)
    assert env == {
        "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "ROLE_NAME": "default",
        "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        # no torchrun store: rank 0 hosts the store of init_process_group("env://") itself
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }


@pytest.mark.parametrize("kwargs, message", [
    (dict(master_addr="", master_port=1), "master_addr '' is empty"),
    (dict(master_addr="h", master_port=0), "master_port 0 is not a TCP port"),
    (dict(master_addr="h", master_port=1, rank=1), r"rank 1 is not on this node \(ranks 0..0\)"),
])
def test_rank_env_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_rank_env(assignment(), **kwargs)


@pytest.mark.parametrize("entrypoint, argv, hosted", [
    (["python", "-c", "pass"], ["/py", "-c", "pass"], False),           # a program: started as is
    (["bash", "run.sh"], ["bash", "run.sh"], False),
    (["python", "train.py", "--lr", "1"],
     ["/py", "-m", WORKER_MODULE, "--no-supervisor", "train.py", "--lr", "1"], True),
    (["python3", "-m", "pkg.mod"], ["/py", "-m", WORKER_MODULE, "--no-supervisor", "-m", "pkg.mod"], True),
])
def test_direct_command(entrypoint, argv, hosted):
    target = target_of_entrypoint(entrypoint, "/py")
    assert (direct_command(target, python="/py"), target.hosted) == (argv, hosted)


# ---------------------------------------------------------------- which launches the zygote forks

PY = "/venv/bin/python"
ZYGOTE_ENV = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


def code(text, *args, interpreter=PY):
    return WorkerTarget(kind=TargetKind.CODE, target=text, args=args, interpreter=interpreter)


SCRIPT = WorkerTarget(kind=TargetKind.SCRIPT, target="train.py", args=("--lr", "1"))
MODULE = WorkerTarget(kind=TargetKind.MODULE, target="pkg.mod")


@pytest.mark.parametrize("target, python, env_changes, expected", [
    (code("pass"), PY, {}, True),
    (code("print(1)", "a", "-b"), PY, {"RELAY_JOB_ID": "J", "OMP_NUM_THREADS": "1"}, True),
    (SCRIPT, PY, {}, True),
    (MODULE, PY, {}, True),
    (code("pass", interpreter="/other/python"), PY, {}, False),           # not the zygote's interpreter
    (SCRIPT, "/other/python", {}, False),                                 # hosted by another interpreter
    (WorkerTarget(kind=TargetKind.PROGRAM, target="bash", args=("run.sh",)), PY, {}, False),  # not python
    (WorkerTarget(kind=TargetKind.PROGRAM, target=PY, args=("-O", "-c", "pass")), PY, {}, False),  # flags
    (code("pass"), PY, {"PYTHONPATH": "/extra"}, False),                 # read at start-up: start it
    (code("pass"), PY, {"PYTHONHASHSEED": "0"}, False),
    (code("pass"), PY, {"LC_ALL": "de_DE.UTF-8"}, False),
    (code("pass"), PY, {"PYTHONUNBUFFERED": None}, False),               # removed
])
def test_zygote_eligible(target, python, env_changes, expected):
    env = {**ZYGOTE_ENV, **{k: v for k, v in env_changes.items() if v is not None}}
    for key in [k for k, v in env_changes.items() if v is None]:
        del env[key]
    assert eligible(target, env, python=python, zygote_python=PY, zygote_env=ZYGOTE_ENV) is expected


def test_startup_environment_keeps_what_the_interpreter_reads_when_it_starts():
    env = {"PYTHONPATH": "a", "LC_ALL": "C", "LANG": "C", "TZ": "UTC", "PATH": "/bin", "RELAY_X": "1"}
    assert startup_environment(env) == {"PYTHONPATH": "a", "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
