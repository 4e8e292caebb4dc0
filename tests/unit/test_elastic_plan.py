"""Elastic data parallel's decisions (pure): the next membership, where training resumes,
whose state is taken, and which samples each member trains."""
from __future__ import annotations

import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.spec import JobSpec
from torchrelay.train.elastic_plan import (Membership, TooFewMembers, after_failure, after_join, keeps_own_state,
                                           member_range, resume_step, state_source)

THREE = Membership(0, 0, (0, 1, 2))


@pytest.mark.parametrize("committed, min_workers, members, start", [
    ({0: 5, 1: 5}, 2, (0, 1), 5),          # member 2 died; both survivors completed 5 steps
    ({0: 6, 1: 5}, 2, (0, 1), 5),          # 0 completed the step whose collective failed for 1
    ({1: 4, 2: 4}, 1, (1, 2), 4),          # member 0 (epoch rank 0) died
    ({0: 3, 1: 3, 2: 3}, 3, (0, 1, 2), 3),  # a collective timed out, nobody died
    ({0: 3, 1: 3, 9: 3}, 2, (0, 1), 3),    # a stranger's record is not a member
])
def test_after_failure(committed, min_workers, members, start):
    nxt = after_failure(THREE, committed, min_workers)
    assert (nxt.epoch, nxt.members, nxt.start_step) == (1, members, start)


def test_too_few_survivors_is_an_error_naming_them():
    with pytest.raises(TooFewMembers, match=r"1 of epoch 0's members \[0, 1, 2\] are left \(\[1\]\), fewer than "
                                            r"min_workers=2"):
        after_failure(THREE, {1: 4}, 2)
    with pytest.raises(TooFewMembers):
        resume_step({})


@pytest.mark.parametrize("committed, source", [
    ({0: 5, 1: 5}, 0), ({0: 6, 1: 5}, 1), ({2: 4, 1: 4}, 1), ({3: 2, 1: 7, 2: 2}, 2),
])
def test_state_source_is_a_member_with_the_fewest_steps(committed, source):
    assert state_source(committed) == source


@pytest.mark.parametrize("joiners, max_workers, members", [
    ([7], 4, (0, 1, 2, 7)),
    ([7, 5], 4, (0, 1, 2, 7)),   # first come, up to max_workers
    ([7, 5], 5, (0, 1, 2, 5, 7)),
    ([1, 7], 5, (0, 1, 2, 7)),   # a member cannot join twice
    ([7], 3, (0, 1, 2)),         # no room
])
def test_after_join(joiners, max_workers, members):
    nxt = after_join(THREE, joiners, max_workers, next_step=9)
    assert (nxt.epoch, nxt.start_step, nxt.members) == (1, 9, members)


def test_every_sample_once_per_epoch_across_membership_changes():
    samples, batch = 100, 12  # 8 full steps and a short last one of 4
    schedule = {0: (0, 1, 2), 3: (0, 1), 5: (0, 1, 7), 8: (1, 7)}  # step -> members from then on
    seen, members = [], schedule[0]
    for step in range(9):
        members = schedule.get(step, members)
        ranges = [member_range(samples, batch, step, members, m) for m in members]
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1  # equal shares of the global batch
        seen += [i for a, b in ranges for i in range(a, b)]
    assert sorted(seen) == list(range(samples))


def test_member_range_refuses_a_stranger_and_a_step_past_the_epoch():
    with pytest.raises(ValueError, match="member 5 is not among"):
        member_range(96, 12, 0, (0, 1), 5)
    with pytest.raises(ValueError, match="outside the epoch"):
        member_range(96, 12, 8, (0, 1), 0)
    with pytest.raises(ValueError, match="not in epoch 0's members"):
        THREE.rank_of(4)
    assert Membership.from_json(THREE.to_json()) == THREE


@pytest.mark.parametrize("elastic, workers, error", [
    ({"min_workers": 2, "max_workers": 4}, 3, None),
    ({"min_workers": 3, "max_workers": 2}, 3, "max_workers=2 is below min_workers=3"),
    ({"min_workers": 4, "max_workers": 5}, 3, "workers=3 is outside strategy.elastic's range [4, 5]"),
    ({"min_workers": 0, "max_workers": 5}, 3, "min_workers"),
    ({"min_workers": 2}, 3, "max_workers"),
])
def test_the_spec_checks_the_elastic_range(elastic, workers, error):
    data = {"entrypoint": "python train.py", "workers": workers, "strategy": {"kind": "ddp", "elastic": elastic}}
    if error is None:
        assert JobSpec.parse(data).strategy.elastic.max_workers == elastic["max_workers"]
    else:
        with pytest.raises(InvalidSpec, match=error.replace("[", r"\[").replace("]", r"\]")):
            JobSpec.parse(data)


@pytest.mark.parametrize("own, source, keeps", [
    (6, 6, True),       # a survivor at the sync point everyone resumes from: its own inner state
    (9, 6, False),      # the sync of step 9 completed for it only: it takes the source's state
    (None, 6, False),   # a joiner has none of its own
    (0, 0, True),       # no sync yet beyond the start
])
def test_keeps_own_state(own, source, keeps):
    assert keeps_own_state(own, source) is keeps


@pytest.mark.parametrize("strategy, error", [
    ({"kind": "local_sgd", "every": 4}, None),
    ({"kind": "diloco", "every": 4, "outer_lr": 0.5}, None),
    ({"kind": "local_sgd", "balance": "throughput"},
     "balance='throughput' does not go with elastic: an elastic job splits each step's global batch equally"),
    ({"kind": "diloco", "balance": "throughput"}, "balance='throughput' does not go with elastic"),
    ({"kind": "ddp"}, None),
    ({"kind": "ddp", "balance": "throughput"}, "balance='throughput' does not go with elastic"),
    ({"kind": "final_average"}, "elastic does not apply to strategy kind 'final_average': its replicas agree only "
                                "at the end"),
    ({"kind": "fsdp"}, "elastic does not apply to strategy kind 'fsdp': each worker holds a shard"),
    ({"kind": "pipeline"}, "elastic does not apply to strategy kind 'pipeline'"),
    ({"kind": "parameter_server"}, "elastic does not apply to strategy kind 'parameter_server'.*it applies to "
                                   "ddp, local_sgd, diloco"),
])
def test_the_spec_takes_elastic_for_ddp_local_sgd_and_diloco_only(strategy, error):
    data = {"entrypoint": "python train.py", "workers": 3,
            "strategy": {**strategy, "elastic": {"min_workers": 2, "max_workers": 4}}}
    if error is None:
        parsed = JobSpec.parse(data).strategy
        assert parsed.kind == strategy["kind"] and (parsed.elastic.min_workers, parsed.elastic.max_workers) == (2, 4)
    else:
        with pytest.raises(InvalidSpec, match=error):
            JobSpec.parse(data)


def test_local_sgd_and_diloco_without_elastic_are_unchanged():
    for kind in ("local_sgd", "diloco"):
        spec = JobSpec.parse({"entrypoint": "python train.py", "workers": 3,
                              "strategy": {"kind": kind, "balance": "throughput"}})
        assert spec.strategy.elastic is None
    with pytest.raises(InvalidSpec, match=r"workers=5 is outside strategy.elastic's range \[2, 4\]"):
        JobSpec.parse({"entrypoint": "python train.py", "workers": 5,
                       "strategy": {"kind": "diloco", "elastic": {"min_workers": 2, "max_workers": 4}}})
