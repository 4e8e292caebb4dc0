"""torchrelay.train.environment (pure: environment parsing, backend choice) and context (init/prepare in a world of 1)."""
from __future__ import annotations

import json

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import InvalidSpec
from torchrelay.spec import DDPStrategy, DiLoCoStrategy, ParameterServerStrategy
from torchrelay.train.environment import choose_backend, context_from_env

pytestmark = pytest.mark.timeout(60)

_TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}


@pytest.mark.parametrize("env, expected", [
    ({}, dict(rank=0, world_size=1, local_rank=0, local_world_size=1, job_id=None, attempt=0)),
    (_TORCHRUN, dict(rank=3, world_size=4, local_rank=1, local_world_size=2)),
    ({"RANK": "1", "WORLD_SIZE": "2"}, dict(rank=1, world_size=2, local_rank=1, local_world_size=2)),
    ({**_TORCHRUN, "RELAY_JOB_ID": "j-1", "RELAY_ATTEMPT": "2"}, dict(job_id="j-1", attempt=2)),
    ({"TORCHELASTIC_RESTART_COUNT": "1"}, dict(attempt=1)),
])
def test_context_from_env(env, expected):
    ctx = context_from_env(env)
    for field, value in expected.items():
        assert getattr(ctx, field) == value, field
    assert ctx.is_main == (ctx.rank == 0)
    assert ctx.device == torch.device("cpu") and not ctx.distributed


@pytest.mark.parametrize("raw, expected", [
    (None, DDPStrategy()),
    ('{"kind": "ddp"}', DDPStrategy()),
    ('{"kind": "diloco", "every": 4}', DiLoCoStrategy(kind="diloco", every=4)),
    ('{"kind": "parameter_server", "servers": 2}', ParameterServerStrategy(kind="parameter_server", servers=2)),
])
def test_strategy_from_env(raw, expected):
    env = {} if raw is None else {"RELAY_STRATEGY": raw}
    assert context_from_env(env).strategy == expected


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be below WORLD_SIZE=2"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
    ({**_TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
    ({"RELAY_STRATEGY": "{kind: ddp"}, "RELAY_STRATEGY='{kind: ddp' is not JSON"),
    ({"RELAY_STRATEGY": '{"kind": "allreduce"}'}, "unknown strategy 'allreduce'"),
    ({"RELAY_STRATEGY": '{"kind": "diloco", "every": 0}'}, "every"),
    ({"RELAY_CHECKPOINT": '{"keep": 0}'}, "RELAY_CHECKPOINT="),
    ({"RELAY_CHECKPOINT": '{"every": 5}'}, "unknown key 'every'"),
    ({"RELAY_ATTEMPT": "-1"}, "RELAY_ATTEMPT='-1' must be >= 0"),
])
def test_bad_environment_is_named(env, fragment):
    with pytest.raises(InvalidSpec) as info:
        context_from_env(env)
    assert fragment in str(info.value)


def test_checkpoint_policy_from_env():
    ctx = context_from_env({"RELAY_CHECKPOINT": json.dumps({"every_steps": 50, "keep": 2, "async": True})})
    assert (ctx.checkpoint.every_steps, ctx.checkpoint.keep, ctx.checkpoint.async_) == (50, 2, True)


@pytest.mark.parametrize("requested, gpus, local_rank, expected", [
    (None, 0, 0, ("gloo", "cpu")),
    (None, 2, 1, ("nccl", "cuda:1")),
    (None, 1, 1, ("gloo", "cpu")),       # more local ranks than GPUs: those without one use the CPU
    ("gloo", 2, 0, ("gloo", "cpu")),
    ("nccl", 1, 0, ("nccl", "cuda:0")),
])
def test_choose_backend(requested, gpus, local_rank, expected):
    assert choose_backend(requested, gpus, local_rank) == expected


@pytest.mark.parametrize("requested, gpus, local_rank, expected", [
    (None, 0, 0, ("gloo", "cpu")),        # a server (or a worker) on a CPU node
    (None, 2, 1, ("gloo", "cuda:1")),     # a GPU worker: same backend as the servers, trains on its GPU
    ("nccl", 1, 0, ("nccl", "cuda:0")),   # asked for explicitly: the script's choice
])
def test_choose_backend_for_a_parameter_server_job(requested, gpus, local_rank, expected):
    assert choose_backend(requested, gpus, local_rank, parameter_server=True) == expected


@pytest.mark.parametrize("requested, gpus, local_rank, expected", [
    (None, 0, 0, ("gloo", "cpu")),        # a CPU rank of a job of accelerator "any"
    (None, 1, 0, ("gloo", "cuda:0")),     # its GPU rank: gloo like every rank, trains on its GPU
    (None, 1, 1, ("gloo", "cpu")),
    ("gloo", 2, 1, ("gloo", "cuda:1")),
])
def test_choose_backend_for_a_mixed_device_job(requested, gpus, local_rank, expected):
    assert choose_backend(requested, gpus, local_rank, mixed_devices=True) == expected


def test_a_mixed_device_job_cannot_ask_for_nccl():
    with pytest.raises(InvalidSpec, match="backend='nccl' in a job of accelerator 'any'"):
        choose_backend("nccl", 1, 0, mixed_devices=True)


@pytest.mark.parametrize("requested, gpus, fragment", [
    ("nccl", 0, "backend='nccl' needs a CUDA device"),
    ("tcp", 0, "backend='tcp' is not one of"),
])
def test_choose_backend_refuses(requested, gpus, fragment):
    with pytest.raises(InvalidSpec, match=fragment):
        choose_backend(requested, gpus, 0)


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RELAY_STRATEGY", "RELAY_METRICS_DIR", "RELAY_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    rt.shutdown()
    yield monkeypatch
    rt.shutdown()


def test_init_is_idempotent_and_needs_no_process_group_alone(single_process):
    ctx = rt.init()
    assert rt.init() is ctx
    assert (ctx.rank, ctx.world_size, ctx.distributed, ctx.backend) == (0, 1, False, None)
    assert not torch.distributed.is_initialized()


def test_init_refuses_a_world_without_rendezvous(single_process):
    single_process.setenv("WORLD_SIZE", "2")
    single_process.setenv("RANK", "0")
    with pytest.raises(InvalidSpec, match="MASTER_ADDR/MASTER_PORT are not set"):
        rt.init()


def test_prepare_ddp_in_a_world_of_one_keeps_ddp_surface(single_process):
    rt.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped, same_optimizer = rt.prepare(model, optimizer)
    assert same_optimizer is optimizer
    assert rt.unwrap(wrapped) is model and wrapped.module is model
    assert list(wrapped.state_dict()) == ["module.weight", "module.bias"]  # as DDP names them
    with wrapped.no_sync():
        loss = wrapped(torch.ones(2, 3)).sum()
    loss.backward()
    before = model.weight.detach().clone()
    optimizer.step()
    assert torch.allclose(model.weight, before - 0.5 * 2.0)  # d(sum)/dw = 2 per weight


def test_prepare_refuses_pipeline(single_process):
    single_process.setenv("RELAY_STRATEGY", '{"kind": "pipeline"}')
    model = torch.nn.Linear(3, 1)
    with pytest.raises(InvalidSpec, match="use torchrelay.train.pipeline"):
        rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_shutdown_is_idempotent(single_process):
    rt.init()
    rt.shutdown()
    rt.shutdown()
    assert rt.init().rank == 0


class _StrategyOptimizer(torch.optim.SGD):
    """An optimizer with the hooks train.sync / train.ps optimizers have, recording the calls."""

    calls: list[str] = []

    def finish(self) -> None:
        self.calls.append("finish")

    def before_checkpoint(self) -> None:
        self.calls.append("before_checkpoint")
        with torch.no_grad():  # as final averaging does: in place, so the state dict sees it
            for group in self.param_groups:
                for param in group["params"]:
                    param.fill_(7.0)

    def close(self) -> None:
        self.calls.append("close")


def test_optimizer_hooks_run_at_finish_checkpoint_and_shutdown(single_process, tmp_path):
    single_process.setenv("RELAY_OUTPUT_DIR", str(tmp_path))
    model = torch.nn.Linear(2, 1)
    optimizer = _StrategyOptimizer(model.parameters(), lr=0.1)
    optimizer.calls = []
    model, optimizer = rt.prepare(model, optimizer)
    rt.finish()
    rt.save_checkpoint({"model": model.state_dict()}, 1)
    state, _step = rt.load_checkpoint()
    assert torch.equal(state["model"]["module.weight"], torch.full((1, 2), 7.0))  # taken after the hook
    rt.shutdown()
    rt.shutdown()
    assert optimizer.calls == ["finish", "before_checkpoint", "close"]


@pytest.mark.parametrize("strategy", ['{"kind": "local_sgd", "every": 2}', '{"kind": "final_average"}'])
def test_prepare_hands_sync_strategies_to_train_sync(single_process, strategy):
    single_process.setenv("RELAY_STRATEGY", strategy)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _model, prepared = rt.prepare(model, optimizer)
    assert type(prepared).__module__ == "torchrelay.train.sync" and prepared is not optimizer


@pytest.mark.parametrize("timeout_s, env_value, expected", [
    (None, None, None), (None, "", None), (30, None, 30.0), (None, "12.5", 12.5), (5, "99", 5.0),
])
def test_collective_timeout(timeout_s, env_value, expected):
    from torchrelay.train.environment import collective_timeout

    got = collective_timeout(timeout_s, env_value)
    assert (got.total_seconds() if got is not None else None) == expected


@pytest.mark.parametrize("timeout_s, env_value, fragment", [
    (None, "soon", "RELAY_COLLECTIVE_TIMEOUT_S='soon' is not a number"),
    (None, "-1", "RELAY_COLLECTIVE_TIMEOUT_S='-1' must be > 0"),
    (0, None, "timeout_s=0 must be"),
    ("10", None, "timeout_s='10' must be"),
])
def test_collective_timeout_refuses(timeout_s, env_value, fragment):
    from torchrelay.train.environment import collective_timeout

    with pytest.raises(InvalidSpec, match=fragment):
        collective_timeout(timeout_s, env_value)
