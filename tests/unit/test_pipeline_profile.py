"""The block profiler measures real sizes and leaves meta blocks on meta."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.train.pipeline.meta import build_on_meta, is_on_meta
from torchrelay.train.pipeline.models import balanced_mlp, char_transformer, lm_loss
from torchrelay.train.pipeline.profile import profile_blocks

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
