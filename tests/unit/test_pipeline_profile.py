"""The block profiler measures real sizes and leaves meta blocks on meta."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from torchrelay.train.pipeline.meta import build_on_meta, is_on_meta
from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss
from torchrelay.train.pipeline.profile import (_time_window, profile_blocks, trimmed_mean,
                                             windows_by_bytes)

pytestmark = pytest.mark.timeout(60)


def test_profile_counts_bytes_of_outputs_params_and_optimizer_state():
    torch.set_num_threads(1)
    blocks = build_on_meta(lambda: balanced_mlp(16, 3))
    costs = profile_blocks(blocks, torch.randn(5, 16), "cpu", warmup=1, repeats=2,
                           optimizer_factory=lambda ps: torch.optim.Adam(ps))
    weights = (16 * 16 + 16) * 4
    for cost in costs:
        assert cost.time_s > 0
        assert cost.out_bytes == 5 * 16 * 4
        # weights, grads, Adam's two moments and its per-tensor step counters
        assert 4 * weights <= cost.param_bytes <= 4 * weights + 2 * 8
        assert cost.stash_bytes >= 5 * 16 * 4   # at least the input Linear keeps
    assert all(is_on_meta(b) for b in blocks)   # profiled copies, originals untouched


def test_profile_without_optimizer_counts_weights_and_grads():
    costs = profile_blocks([nn.Linear(8, 4)], torch.randn(2, 8), warmup=0, repeats=1)
    assert costs[0].param_bytes == 2 * (8 * 4 + 4) * 4


def test_profile_includes_loss_on_last_block_and_sees_the_big_head():
    blocks = build_on_meta(lambda: char_transformer(vocab=2048, dim=16, depth=1, heads=2,
                                                    context=8))
    ids = torch.randint(0, 2048, (2, 8))
    costs = profile_blocks(blocks, ids, warmup=1, repeats=1, loss_fn=lm_loss, sample_target=ids)
    assert [c.name.split(":")[1] for c in costs] == ["TokenEmbedding", "TransformerBlock",
                                                    "Sequential"]
    assert costs[-1].out_bytes == 2 * 8 * 2048 * 4
    assert costs[0].param_bytes > 10 * costs[1].param_bytes  # the 2048-row embedding


def test_profile_names_a_block_that_returns_no_tensor():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    with pytest.raises(ValueError, match="block 0 \\(Pair\\)"):
        profile_blocks([Pair()], torch.randn(2, 2))


@pytest.mark.parametrize("sizes, limit, expected", [
    ([1, 1, 1, 1], None, [(0, 4)]),          # no limit: one chain of everything
    ([1, 1, 1, 1], 2, [(0, 2), (2, 4)]),
    ([3, 1, 1, 5, 1], 3, [(0, 1), (1, 3), (3, 4), (4, 5)]),  # a block over the limit alone
    ([2, 2, 2], 5, [(0, 2), (2, 3)]),
    ([], 4, []),
])
def test_profile_windows_hold_consecutive_blocks_within_the_byte_limit(sizes, limit, expected):
    spans = windows_by_bytes(sizes, limit)
    assert [(r.start, r.stop) for r in spans] == expected


def test_chained_profile_in_windows_matches_one_window_in_everything_but_time():
    torch.set_num_threads(1)
    blocks = build_on_meta(lambda: char_transformer(vocab=512, dim=16, depth=3, heads=2,
                                                    context=8))
    ids = torch.randint(0, 512, (2, 8))
    whole = profile_blocks(blocks, ids, warmup=0, repeats=1, loss_fn=lm_loss, sample_target=ids)
    # windows of one block each (the smallest possible limit)
    single = profile_blocks(blocks, ids, warmup=0, repeats=1, loss_fn=lm_loss,
                            sample_target=ids, window_bytes=1)
    assert len(whole) == len(single) == 5
    for a, b in zip(whole, single):
        assert (a.name, a.out_bytes, a.param_bytes, a.stash_bytes) == \
            (b.name, b.out_bytes, b.param_bytes, b.stash_bytes)
        assert a.time_s > 0 and b.time_s > 0


@pytest.mark.parametrize("values, expected", [
    ([], 0.0),
    ([5.0], 5.0),
    ([1.0, 2.0, 3.0, 4.0], 2.5),                   # fewer than 5: nothing trimmed
    ([100.0, 1.0, 2.0, 3.0, 4.0], 3.0),             # one of five trimmed at each end
    ([20.0, 30.0, 21.0, 29.0, 22.0, 31.0, 0.0, 99.0, 25.0, 26.0], 25.5),  # bimodal, 2 bursts
])
def test_trimmed_mean_drops_a_fifth_at_each_end(values, expected):
    assert trimmed_mean(values) == pytest.approx(expected)


class _Recorder(nn.Module):
    """Logs its forwards and the backwards through it, in order."""

    def __init__(self, log: list[str]):
        super().__init__()
        self.log = log
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        self.log.append("F")
        out = x * self.weight
        out.register_hook(lambda g: self.log.append("B"))
        return out


@pytest.mark.parametrize("in_flight, expected", [
    (0, "FBFBFB"),
    (1, "FFBFBFB"),          # 1F1B on a stage with one more micro-batch in flight
    (2, "FFFBFBFB"),
])
def test_window_timing_interleaves_forwards_as_1f1b_does(in_flight, expected):
    log: list[str] = []
    samples = _time_window([_Recorder(log)], torch.randn(3), None, torch.device("cpu"),
                           time.perf_counter, runs=3, in_flight=in_flight)
    assert "".join(log) == expected
    assert [len(s) for s in samples] == [3]


def test_profile_runs_the_window_that_ends_the_model_without_interleaving():
    log: list[str] = []
    blocks = [_Recorder(log), _Recorder(log)]
    profile_blocks(blocks, torch.randn(3), warmup=0, repeats=2, window_bytes=1,
                   loss_fn=lambda out, target: (out - target).pow(2).sum(),
                   sample_target=torch.zeros(3), in_flight=1)
    # block 0's window (not last): F F B F B after the stash pass's F; block 1's: F B F B
    assert "".join(log) == "F" + "FFBFB" + "F" + "FBFB"


def test_profile_refuses_a_negative_in_flight():
    with pytest.raises(ValueError, match="in_flight=-1"):
        profile_blocks([nn.Linear(2, 2)], torch.randn(1, 2), in_flight=-1)


def test_time_stage_runs_a_stage_from_its_input_and_leaves_the_model_on_meta():
    from torchrelay.train.pipeline.profile import time_stage
    blocks = build_on_meta(lambda: char_transformer(vocab=256, dim=16, depth=3, heads=2,
                                                    context=8))
    ids = torch.randint(0, 256, (2, 8))
    inputs: list = []
    profile_blocks(blocks, ids, warmup=1, repeats=1, loss_fn=lm_loss, sample_target=ids,
                   block_inputs=inputs)
    assert len(inputs) == len(blocks) and inputs[0].dtype == torch.int64
    assert inputs[2].shape == (2, 8, 16)  # what block 1 hands to block 2
    middle = time_stage(blocks, 1, 3, inputs[1], warmup=1, repeats=2)
    last = time_stage(blocks, 3, 5, inputs[3], loss_fn=lm_loss, sample_target=ids,
                      warmup=1, repeats=2)
    assert middle > 0 and last > 0
    assert all(is_on_meta(b) for b in blocks)  # timed on materialised copies
