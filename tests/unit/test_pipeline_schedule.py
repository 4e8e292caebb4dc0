"""Pure parts of the pipeline runtime: schedule orders, micro-batch sizes, block helpers,
and the plan file for ``relay status``."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.train.pipeline.meta import (as_blocks, build_on_meta, is_on_meta,
                                            materialize_module, transformer_blocks)
from torchrelay.train.pipeline.models import balanced_mlp, char_transformer
from torchrelay.train.pipeline.partition import BlockCost, DeviceSpec, plan_stages
from torchrelay.train.pipeline.runtime import microbatch_sizes, replay_step, schedule_actions

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("schedule, stage, stages, m, expected", [
    ("gpipe", 0, 2, 2, "F0 F1 B0 B1"),
    ("1f1b", 0, 2, 4, "F0 F1 B0 F2 B1 F3 B2 B3"),
    ("1f1b", 1, 2, 4, "F0 B0 F1 B1 F2 B2 F3 B3"),
    ("1f1b", 0, 3, 4, "F0 F1 F2 B0 F3 B1 B2 B3"),
    ("1f1b", 0, 4, 2, "F0 F1 B0 B1"),   # fewer micro-batches than warm-up slots
])
def test_schedule_table(schedule, stage, stages, m, expected):
    actions = schedule_actions(schedule, stage, stages, m)
    assert " ".join(f"{k}{i}" for k, i in actions) == expected


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_1f1b_runs_each_microbatch_once_forward_before_backward(stages, m):
    for stage in range(stages):
        actions = schedule_actions("1f1b", stage, stages, m)
        assert sorted(a for a in actions if a[0] == "F") == [("F", i) for i in range(m)]
        assert sorted(a for a in actions if a[0] == "B") == [("B", i) for i in range(m)]
        assert all(actions.index(("F", i)) < actions.index(("B", i)) for i in range(m))
        # at most stages - stage micro-batches are in flight at once
        in_flight = peak = 0
        for kind, _ in actions:
            in_flight += 1 if kind == "F" else -1
            peak = max(peak, in_flight)
        assert peak <= min(stages - stage, m)


def test_schedule_refuses_unknown():
    with pytest.raises(InvalidSpec, match="'interleaved_1f1b'"):
        schedule_actions("interleaved_1f1b", 0, 2, 4)


@pytest.mark.parametrize("batch, m, sizes", [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]),
                                             (3, 3, [1, 1, 1])])
def test_microbatch_sizes_match_tensor_split(batch, m, sizes):
    assert microbatch_sizes(batch, m) == sizes
    assert [len(c) for c in torch.tensor_split(torch.zeros(batch), m)] == sizes


def test_microbatch_sizes_refuse_empty_chunks():
    with pytest.raises(InvalidSpec, match="batch of 3 cannot make 4"):
        microbatch_sizes(3, 4)


def test_meta_blocks_materialise_reproducibly():
    meta = build_on_meta(lambda: char_transformer(vocab=64, dim=16, depth=2, heads=2, context=8))
    assert all(is_on_meta(b) for b in meta)
    a = materialize_module(build_on_meta(lambda: char_transformer(64, 16, 2, 2, 8))[1], "cpu", 7)
    b = materialize_module(meta[1], "cpu", 7)
    assert not is_on_meta(b)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    c = materialize_module(build_on_meta(lambda: balanced_mlp(16, 1))[0], "cpu", 8)
    d = materialize_module(build_on_meta(lambda: balanced_mlp(16, 1))[0], "cpu", 9)
    assert not torch.equal(c[0].weight, d[0].weight)


def test_materialise_refuses_module_without_reset():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with pytest.raises(ValueError, match="Bare"):
        materialize_module(build_on_meta(Bare), "cpu", 0)


def test_block_helpers():
    emb, head = nn.Embedding(5, 4), (nn.LayerNorm(4), nn.Linear(4, 5))
    blocks = transformer_blocks(emb, [nn.Identity(), nn.Identity()], head)
    assert len(blocks) == 4 and isinstance(blocks[-1], nn.Sequential)
    assert as_blocks(nn.Sequential(*blocks)) == blocks
    with pytest.raises(TypeError, match="Linear"):
        as_blocks(nn.Linear(2, 2))


def test_plan_is_published_for_relay_status(tmp_path):
    import json

    from torchrelay.train.pipeline.api import publish_plan

    plan = plan_stages([BlockCost(1.0), BlockCost(2.0), BlockCost(3.0)],
                       [DeviceSpec("a"), DeviceSpec("b")])
    assert publish_plan(plan, env={}) is None
    path = publish_plan(plan, env={"RELAY_METRICS_DIR": str(tmp_path / "m")})
    data = json.loads(open(path).read())
    assert data["stages"] == plan.to_dict()["stages"] and "stage 0 on a" in data["text"]


def _trace(stage, stages, m, f, b, schedule="1f1b"):
    return [(kind, i, f if kind == "F" else b)
            for kind, i in schedule_actions(schedule, stage, stages, m)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages, m", [(2, 8), (3, 4), (4, 8)])
def test_replay_of_balanced_stages_gives_the_textbook_step(schedule, stages, m):
    # forward 1, backward 2 on every stage: (m + stages - 1) * 3
    traces = [_trace(k, stages, m, 1.0, 2.0, schedule) for k in range(stages)]
    assert replay_step(traces) == pytest.approx((m + stages - 1) * 3.0)


def test_replay_counts_the_slowest_stage_and_a_split_backward():
    slow = [_trace(0, 2, 4, 1.0, 2.0), _trace(1, 2, 4, 2.0, 4.0)]
    # stage 0's F0, then stage 1 back to back (4 × 6), then stage 0's last backward
    assert replay_step(slow) == pytest.approx(1 + 24 + 2)
    # stage 1 splits its last backward into input (1) and weights (3): stage 0's last
    # backward starts 3 earlier and runs alongside the weights' part
    split = [_trace(0, 2, 4, 1.0, 2.0), _trace(1, 2, 4, 2.0, 4.0)[:-1] + [("B", 3, 1.0),
                                                                          ("W", 3, 3.0)]]
    assert replay_step(split) == pytest.approx(1 + 18 + 2 + 1 + 3)


def test_replay_refuses_traces_that_cannot_finish():
    with pytest.raises(ValueError, match="cannot finish"):
        replay_step([[("B", 0, 1.0)], [("F", 1, 1.0)]])
