"""The lean runtime's split backward (input part, then weights' part) equals one backward.

Table of stage modules, built directly (no process group: the split is local to a stage):
each runs the split micro-batch's forward as ``LeanPipeline.step`` does, then
``_backward_input`` + ``_backward_weights``, against ``backward()`` on the same inputs.
"""
import pytest
import torch
from torch import nn

from torchrelay.train.pipeline.runtime import LeanPipeline


class Residual(nn.Sequential):
    """A Sequential subclass whose forward is not its children in turn."""

    def forward(self, x):
        return x + super().forward(x)


class WithUnusedParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.linear(x)


def _shared_layer_stage():
    shared = nn.Linear(8, 8)
    return nn.Sequential(shared, nn.Tanh(), shared)


CASES = {
    "linear+tanh blocks": lambda: nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                                  for _ in range(3)]),
    "one block": lambda: nn.Sequential(nn.Linear(8, 8)),
    "a bare module": lambda: nn.Linear(8, 8),
    "identity blocks around": lambda: nn.Sequential(nn.Identity(), nn.Linear(8, 8),
                                                    nn.Identity(), nn.Linear(8, 8)),
    "in-place relu": lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True),
                                           nn.Linear(8, 8)),
    "a layer used twice": _shared_layer_stage,
    "Sequential subclass": lambda: Residual(nn.Linear(8, 8), nn.Tanh()),
    "unused parameter": lambda: nn.Sequential(nn.Linear(8, 8), WithUnusedParameter()),
}


def _runner(module):
    return LeanPipeline(module, stage=1, num_stages=2, microbatches=1,
                        loss_fn=lambda out, target: (out - target).square().mean(),
                        schedule="1f1b", prev_rank=0, next_rank=None,
                        device=torch.device("cpu"))


def _grads(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_backward_equals_plain_backward(name):
    torch.manual_seed(0)
    module = CASES[name]()
    x, target = torch.randn(4, 8), torch.randn(4, 8)

    plain_input = x.clone().requires_grad_()
    (module(plain_input) - target).square().mean().backward()
    expected = _grads(module)
    module.zero_grad(set_to_none=True)

    runner = _runner(module)
    out, block_inputs = x.clone().requires_grad_(), []
    for block in runner._blocks:  # as LeanPipeline.step runs the split micro-batch
        block_inputs.append(out)
        out = block(out)
    loss = (out - target).square().mean()
    grads = runner._backward_input(loss, None, block_inputs)
    assert grads, name  # every case here can be split
    runner._backward_weights(loss, None, block_inputs, grads)

    assert torch.allclose(block_inputs[0].grad, plain_input.grad, atol=1e-6), name
    for got, want in zip(_grads(module), expected):
        assert (got is None) == (want is None), name
        if want is not None:
            assert torch.allclose(got, want, atol=1e-6), name


def test_stage_without_parameters_is_not_split():
    runner = _runner(nn.Sequential(nn.Tanh(), nn.Tanh()))
    x = torch.randn(4, 8, requires_grad=True)
    assert runner._backward_input(runner.module(x).sum(), None, [x]) == ()
