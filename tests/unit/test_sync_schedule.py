"""Pure parts of torchrelay.train.sync: the schedule, strategy checks, and one-process behaviour."""
from __future__ import annotations

import io
from dataclasses import dataclass

import pytest
import torch

from torchrelay.errors import InvalidSpec
from torchrelay.spec import DDPStrategy, DiLoCoStrategy, FinalAverageStrategy, LocalSGDStrategy, PipelineStrategy
from torchrelay.train import sync

pytestmark = pytest.mark.timeout(30)


@dataclass
class Ctx:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"


@pytest.mark.parametrize("every, warmup, grad_steps, param_steps", [
    (1, 0, [], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    (4, 0, [], [4, 8]),
    (4, 2, [1, 2], [6, 10]),
    (3, 5, [1, 2, 3, 4, 5], [8]),
    (16, 0, [], []),
])
def test_schedule_names_the_steps_that_communicate(every, warmup, grad_steps, param_steps):
    schedule = sync.PeriodicSchedule(every=every, warmup_steps=warmup)
    assert [k for k in range(1, 11) if schedule.averages_gradients(k)] == grad_steps
    assert [k for k in range(1, 11) if schedule.syncs_parameters(k)] == param_steps
    assert schedule.syncs_in(1, 10) == len(param_steps)


@pytest.mark.parametrize("every, warmup, message", [
    (0, 0, "strategy.every=0"), (2, -1, "strategy.warmup_steps=-1"), (1.5, 0, "strategy.every=1.5"),
])
def test_schedule_refuses_bad_values_by_name(every, warmup, message):
    with pytest.raises(InvalidSpec, match=message):
        sync.PeriodicSchedule(every=every, warmup_steps=warmup)


def _model_and_opt(lr: float = 0.1):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def test_prepare_refuses_strategies_it_does_not_handle():
    model, opt = _model_and_opt()
    with pytest.raises(InvalidSpec, match="'pipeline' is not a synchronisation strategy.*local_sgd"):
        sync.prepare(model, opt, PipelineStrategy(kind="pipeline"), Ctx())
    with pytest.raises(InvalidSpec, match="every"):
        sync.prepare(model, opt, {"kind": "local_sgd", "every": 0}, Ctx())


@pytest.mark.parametrize("ctx, message", [
    (Ctx(rank=2, world_size=2), "ctx.rank=2"), (Ctx(world_size=0), "ctx.world_size=0"),
    (Ctx(rank=0, world_size=2), "init_process_group"),
])
def test_prepare_refuses_a_context_that_does_not_fit(ctx, message):
    model, opt = _model_and_opt()
    with pytest.raises((InvalidSpec, RuntimeError), match=message):
        sync.prepare(model, opt, LocalSGDStrategy(kind="local_sgd"), ctx)


def test_prepare_refuses_an_optimizer_missing_model_parameters():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(InvalidSpec, match="not in the optimizer"):
        sync.prepare(model, opt, DiLoCoStrategy(kind="diloco"), Ctx())


@pytest.mark.parametrize("strategy", [DDPStrategy(), LocalSGDStrategy(kind="local_sgd", every=2, warmup_steps=1),
                                      DiLoCoStrategy(kind="diloco", every=2, outer_lr=1.0, outer_momentum=0.0),
                                      FinalAverageStrategy(kind="final_average")])
def test_one_process_trains_like_the_plain_optimizer_and_sends_nothing(strategy):
    plain, plain_opt = _model_and_opt()
    model, opt = _model_and_opt()
    model, opt = sync.prepare(model, opt, strategy, Ctx())
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        for m, o in ((plain, plain_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        assert opt.metrics()["bytes_sent"] == 0
    sync.finish(model, opt)
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    assert opt.replicas_identical


def test_state_dict_round_trips_through_torch_save_and_keeps_the_schedule():
    model, opt = _model_and_opt()
    model, opt = sync.prepare(model, opt, DiLoCoStrategy(kind="diloco", every=3), Ctx())
    for _ in range(4):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    other_model, other = _model_and_opt()
    other_model, other = sync.prepare(other_model, other, DiLoCoStrategy(kind="diloco", every=3), Ctx())
    other.load_state_dict(torch.load(buffer, weights_only=False))
    assert other.steps_done == 4
    rule, saved_rule = other.rules[0], opt.rules[0]
    assert rule.synced_at == 3
    for a, b in zip(rule.global_params, saved_rule.global_params):
        assert torch.equal(a, b)
    assert other.inner.state_dict()["state"].keys() == opt.inner.state_dict()["state"].keys()


def test_load_state_dict_accepts_a_plain_optimizer_state_and_warns_on_another_strategy():
    model, opt = _model_and_opt()
    plain_state = opt.state_dict()
    model, opt = sync.prepare(model, opt, LocalSGDStrategy(kind="local_sgd", every=2), Ctx())
    opt.load_state_dict(plain_state)
    assert opt.steps_done == 0
    other = {"inner": plain_state, "sync": {"kind": "diloco", "steps_done": 7, "rules": [{}]}}
    with pytest.warns(UserWarning, match="'diloco'.*'local_sgd'"):
        opt.load_state_dict(other)
    assert opt.steps_done == 7 and opt.rules[0].synced_at == 7


def test_wrapped_optimizer_works_with_an_lr_scheduler():
    model, opt = _model_and_opt(lr=1.0)
    model, opt = sync.prepare(model, opt, LocalSGDStrategy(kind="local_sgd", every=2), Ctx())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        scheduler.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.125)
