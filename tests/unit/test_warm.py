"""Which launches the warm zygote may fork, and the environment each rank gets (pure)."""
from __future__ import annotations

import pytest

from torchrelay import wire
from torchrelay.agent.commands import build_rank_env
from torchrelay.agent.target import target_of_entrypoint
from torchrelay.agent.launcher import elastic_survived
from torchrelay.agent.warm import elastic_min_workers, warm_rank_env, warm_refusal
from torchrelay.agent.zygote import refusal, startup_environment

ZYGOTE_ENV = {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}


def assignment(**kw) -> wire.LaunchAssignment:
    base = dict(launch_id="l", job_id="j", attempt=0, desired="run", node_rank=1, nnodes=2, nproc_per_node=2,
                world_size=4, rank_offset=2, entrypoint=["python", "train.py"], bundle=None, store_url="/s",
                job_store_prefix="jobs/j")
    return wire.LaunchAssignment(**{**base, **kw})


@pytest.mark.parametrize("entrypoint, env, python, why", [
    (["python", "train.py"], {}, "/py", None),
    (["python", "-m", "pkg.train"], {"RELAY_JOB_ID": "x", "MY_FLAG": "1"}, "/py", None),
    (["python", "train.py"], {"RELAY_FRESH_INTERPRETER": "0"}, "/py", None),
    (["python", "train.py"], {"RELAY_FRESH_INTERPRETER": "1"}, "/py", "asks for fresh interpreters"),
    (["python", "train.py"], {}, "/other/python", "is not the zygote's '/py'"),
    (["./train.sh"], {}, "/py", "is not a Python script"),
    (["python", "train.py"], {"PYTHONPATH": "/x"}, "/py", "sets PYTHONPATH differently"),
    (["python", "train.py"], {"OMP_NUM_THREADS": "4"}, "/py", "sets OMP_NUM_THREADS differently"),
    (["python", "train.py"], {"MKL_NUM_THREADS": "2"}, "/py", "sets MKL_NUM_THREADS differently"),
])
def test_warm_refusal(entrypoint, env, python, why):
    target = target_of_entrypoint(entrypoint, python)
    got = warm_refusal(target, {**ZYGOTE_ENV, **env}, python=python, zygote_python="/py", zygote_env=ZYGOTE_ENV)
    assert (got is None) if why is None else (why in got), got


def test_threading_variables_matter_only_to_a_zygote_that_preloaded_libraries():
    target = target_of_entrypoint(["python", "train.py"], "/py")
    env = {**ZYGOTE_ENV, "OMP_NUM_THREADS": "4"}
    assert refusal(target, env, python="/py", zygote_python="/py", zygote_env=ZYGOTE_ENV) is None
    assert "OMP_NUM_THREADS" in refusal(target, env, python="/py", zygote_python="/py", zygote_env=ZYGOTE_ENV,
                                        threads=True)
    assert startup_environment(env) == {"PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


def test_a_rank_gets_torchruns_variables_with_the_agent_store():
    env = warm_rank_env(assignment(), master_addr="10.0.0.1", master_port=29500, rank=3, error_file="/r/e.json")
    plain = build_rank_env(assignment(), master_addr="10.0.0.1", master_port=29500, rank=3)
    assert env == {**plain, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": "/r/e.json"}
    assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"], env["WORLD_SIZE"]) == ("3", "1", "1", "4")


@pytest.mark.parametrize("strategy, min_workers", [
    (None, None), ("not json", None), ('["x"]', None), ('{"kind": "ddp"}', None),
    ('{"kind": "ddp", "elastic": null}', None),
    ('{"kind": "ddp", "elastic": {"min_workers": 2, "max_workers": 3}}', 2),
])
def test_elastic_min_workers(strategy, min_workers):
    assert elastic_min_workers({} if strategy is None else {"RELAY_STRATEGY": strategy}) == min_workers


def test_an_elastic_launch_succeeds_with_min_workers_returned():
    def ranks(*returned):
        return [wire.RankExit(rank=i, exit_code=0 if r else None, signal=None if r else 9, returned=r)
                for i, r in enumerate(returned)]

    assert elastic_survived(ranks(True, True, False), 2) is True
    assert elastic_survived(ranks(True, False, False), 2) is False
    assert elastic_survived(ranks(True, True, False), None) is False  # not elastic: every rank must return


def test_a_compiler_setting_read_at_import_sends_the_job_to_torchrun():
    target = target_of_entrypoint(["python", "train.py"], "/py")
    env = {**ZYGOTE_ENV, "TORCHINDUCTOR_CACHE_DIR": "/scratch/inductor"}
    why = warm_refusal(target, env, python="/py", zygote_python="/py", zygote_env=ZYGOTE_ENV)
    assert why is not None and "TORCHINDUCTOR_CACHE_DIR" in why
