"""The worker's session and its pure parts: the stop agreement, the roles, the optimizer protocol."""
from __future__ import annotations

import pytest
import torch

from torchrelay.spec import CheckpointPolicy, DDPStrategy, ParameterServerStrategy
from torchrelay.train.checkpoint import is_checkpoint_step
from torchrelay.train.prepared import StrategyOptimizer, UserOptimizer, strategy_optimizer
from torchrelay.train.ps.client import PSOptimizer
from torchrelay.train.roles import Roles
from torchrelay.train.session import Session
from torchrelay.train.stop_agreement import MAX_PERIOD, StopAgreement
from torchrelay.train.sync import SyncOptimizer

PS1 = ParameterServerStrategy(kind="parameter_server", servers=1)


# ---------------------------------------------------------------- stop agreement


def _calls(agreement: StopAgreement, calls: list[tuple[bool, float]]) -> list[bool]:
    return [agreement.record_call(from_checkpoint_due=due, now=now) for due, now in calls]


@pytest.mark.parametrize("calls, expected", [
    ([(True, 0.0)], [True]),                                   # the first call reduces
    ([(False, 0.0)], [True]),                                  # should_stop alone reduces too
    ([(True, 0.0), (False, 0.0)], [True, False]),              # once checkpoint_due is seen, should_stop only reads
    ([(False, 0.0), (True, 0.1), (False, 0.2)], [True, True, False]),
])
def test_which_calls_reduce_before_any_agreed_period(calls, expected):
    assert _calls(StopAgreement(), calls) == expected


def test_an_agreed_period_skips_that_many_counted_calls():
    agreement = StopAgreement()
    assert _calls(agreement, [(True, 0.0)]) == [True]
    assert agreement.apply(any_rank_stops=False, agreed_period=3) is False
    assert _calls(agreement, [(True, 0.1), (False, 0.1), (True, 0.2), (True, 0.3)]) == [False, False, False, True]


@pytest.mark.parametrize("times, expected", [
    ([], 1),                          # no interval known yet: reduce at the next call
    ([0.0], 1),
    ([0.0, 0.01], 50),                # 10 ms steps: half a second is 50 calls
    ([0.0, 0.0001], MAX_PERIOD),      # capped
    ([0.0, 2.0], 1),                  # slow steps: every call
    ([0.0, 0.01, 0.06], 27),          # smoothed: 0.8 * 10 ms + 0.2 * 50 ms = 18 ms; 0.5 s / 18 ms = 27.8
])
def test_proposed_period_is_about_half_a_second_of_calls(times, expected):
    agreement = StopAgreement()
    _calls(agreement, [(True, t) for t in times])
    assert agreement.proposed_period() == expected


def test_an_agreed_stop_sticks():
    agreement = StopAgreement()
    agreement.record_call(from_checkpoint_due=True, now=0.0)
    assert agreement.apply(any_rank_stops=True, agreed_period=1) is True
    assert agreement.agreed


# ---------------------------------------------------------------- roles


@pytest.mark.parametrize("rank, world, strategy, is_server, data_world, collectives", [
    (0, 1, None, False, (0, 1), True),
    (1, 4, DDPStrategy(), False, (1, 4), True),
    (0, 3, PS1, False, (0, 2), False),
    (1, 3, PS1, False, (1, 2), False),
    (2, 3, PS1, True, None, False),
    (3, 5, ParameterServerStrategy(kind="parameter_server", servers=2), True, None, False),
])
def test_roles(rank, world, strategy, is_server, data_world, collectives):
    roles = Roles.of(rank, world, strategy)
    assert roles.is_server == is_server
    assert roles.collectives_on_default_group == collectives
    if data_world is None:
        with pytest.raises(ValueError, match=f"rank {rank} is a parameter server"):
            roles.data_world()
    else:
        assert roles.data_world() == data_world


def test_a_parameter_server_world_without_workers_is_refused():
    with pytest.raises(ValueError, match="leaves no workers"):
        Roles.of(0, 1, PS1)


# ---------------------------------------------------------------- checkpoint policy


@pytest.mark.parametrize("every, step, expected", [
    (0, 10, False), (5, 0, False), (5, 5, True), (5, 7, False), (5, 10, True), (1, 1, True),
])
def test_is_checkpoint_step(every, step, expected):
    assert is_checkpoint_step(step, CheckpointPolicy(every_steps=every)) is expected


# ---------------------------------------------------------------- optimizer protocol


def test_the_strategies_optimizers_declare_the_protocol():
    assert issubclass(SyncOptimizer, StrategyOptimizer) and issubclass(PSOptimizer, StrategyOptimizer)


class _Declared(StrategyOptimizer):
    def metrics(self):
        return {"x": 1.0}


class _OwnHooks(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.calls = []

    def metrics(self):
        return {"sync_rounds": 2}

    def finish(self):
        self.calls.append("finish")

    def close(self):
        self.calls.append("close")


def test_a_declared_optimizer_is_its_own_protocol():
    declared = _Declared()
    assert strategy_optimizer(declared) is declared
    assert declared.inner is None and declared.per_replica_tensors() == []


def test_a_plain_optimizer_gets_do_nothing_hooks():
    plain = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    hooks = strategy_optimizer(plain)
    assert isinstance(hooks, UserOptimizer) and hooks.optimizer is plain and hooks.inner is None
    assert hooks.metrics() == {} and hooks.per_replica_tensors() == []
    hooks.before_checkpoint()
    hooks.finish()
    hooks.close()


def test_a_users_optimizer_with_its_own_hooks_has_them_run():
    own = _OwnHooks(torch.nn.Linear(2, 1).parameters())
    hooks = strategy_optimizer(own)
    assert hooks.metrics() == {"sync_rounds": 2}
    hooks.before_checkpoint()  # it has none
    hooks.finish()
    hooks.close()
    assert own.calls == ["finish", "close"]


def test_the_session_remembers_and_forgets_the_prepared_optimizer():
    session = Session()
    assert session.optimizer is None and session.hooks.metrics() == {}
    declared = _Declared()
    session.adopt_optimizer(declared)
    assert session.hooks is declared
    assert session.forget_prepared() == (declared, declared)
    assert session.optimizer is None and isinstance(session.hooks, UserOptimizer)


def test_a_session_without_init_reads_its_context_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RELAY_STRATEGY", '{"kind": "parameter_server", "servers": 1}')
    ctx = Session().known_context()
    assert (ctx.rank, ctx.world_size, ctx.strategy.kind) == (1, 3, "parameter_server")
