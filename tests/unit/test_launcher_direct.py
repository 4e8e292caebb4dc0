"""Pure parts of the direct launch (a world of one, no torchrun), of the zygote's choice and of
status coalescing."""
from __future__ import annotations

import pytest

from torchrelay import wire
from torchrelay.agent.daemon import coalesce_statuses, settled_statuses
from torchrelay.agent.launcher import WORKER_MODULE, build_direct_command, build_rank_env, is_direct
from torchrelay.agent.zygote import eligible, startup_environment

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
    assert build_direct_command(assignment(entrypoint=entrypoint), python="/py") == (argv, hosted)


def st(state, port=None):
    return wire.LaunchStatus(state=state, master_port=port)


@pytest.mark.parametrize("outbox, kept", [
    ([], []),
    ([("a", st("preparing"))], [0]),                                          # alone: sent
    ([("a", st("preparing")), ("a", st("running")), ("a", st("exited"))], [1, 2]),
    ([("a", st("preparing")), ("a", st("preparing", 5)), ("a", st("running", 5))], [2]),
    ([("a", st("preparing")), ("b", st("preparing")), ("a", st("running"))], [1, 2]),  # b's is its last
    ([("a", st("running")), ("a", st("exited"))], [0, 1]),                   # both in the history
])
def test_coalesce_statuses(outbox, kept):
    result = coalesce_statuses(outbox)
    assert [outbox.index(e) for e in result] == kept
    assert all(any(r is e for e in outbox) for r in result)  # the same objects


def test_settled_statuses_are_those_up_to_each_launchs_last_sent():
    outbox = [("a", st("preparing")), ("b", st("preparing")), ("a", st("running")), ("b", st("running")),
              ("a", st("exited"))]
    sent = [outbox[2]]  # a's running got through, then the server went away
    assert settled_statuses(outbox, sent) == outbox[:1] + outbox[2:3]
    assert settled_statuses(outbox, []) == []
    assert settled_statuses(outbox, [outbox[1], outbox[4]]) == [outbox[0], outbox[1], outbox[2], outbox[4]]


# ---------------------------------------------------------------- which launches the zygote forks

PY = "/venv/bin/python"
ZYGOTE_ENV = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


@pytest.mark.parametrize("argv, env_changes, expected", [
    ([PY, "-c", "pass"], {}, ("code", "pass", [])),
    ([PY, "-c", "print(1)", "a", "-b"], {"RELAY_JOB_ID": "J", "OMP_NUM_THREADS": "1"},
     ("code", "print(1)", ["a", "-b"])),
    ([PY, "-m", WORKER_MODULE, "--no-supervisor", "train.py", "--lr", "1"], {}, ("script", "train.py", ["--lr", "1"])),
    ([PY, "-m", WORKER_MODULE, "--no-supervisor", "-m", "pkg.mod"], {}, ("module", "pkg.mod", [])),
    (["/other/python", "-c", "pass"], {}, None),                      # not the zygote's interpreter
    (["bash", "run.sh"], {}, None),                                   # not python at all
    ([PY, "-O", "-c", "pass"], {}, None),                             # interpreter flags: start it
    ([PY, "-c"], {}, None),
    ([PY, "-c", "pass"], {"PYTHONPATH": "/extra"}, None),             # read at start-up: start it
    ([PY, "-c", "pass"], {"PYTHONHASHSEED": "0"}, None),
    ([PY, "-c", "pass"], {"LC_ALL": "de_DE.UTF-8"}, None),
    ([PY, "-c", "pass"], {"PYTHONUNBUFFERED": None}, None),           # removed
])
def test_zygote_eligible(argv, env_changes, expected):
    env = {**ZYGOTE_ENV, **{k: v for k, v in env_changes.items() if v is not None}}
    for key in [k for k, v in env_changes.items() if v is None]:
        del env[key]
    assert eligible(argv, env, python=PY, zygote_env=ZYGOTE_ENV) == expected


def test_startup_environment_keeps_what_the_interpreter_reads_when_it_starts():
    env = {"PYTHONPATH": "a", "LC_ALL": "C", "LANG": "C", "TZ": "UTC", "PATH": "/bin", "RELAY_X": "1"}
    assert startup_environment(env) == {"PYTHONPATH": "a", "LC_ALL": "C", "LANG": "C", "TZ": "UTC"}
