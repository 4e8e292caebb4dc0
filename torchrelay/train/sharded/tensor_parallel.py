"""``apply_tensor_parallel``: split the linear layers of attention and MLP blocks over a 1-D mesh.

Contract:
- The plan says, per ``nn.Linear`` (dotted name), ``"colwise"`` (output features split: each rank
  computes its slice) or ``"rowwise"`` (input features split; the partial outputs summed across
  the group), the Megatron pairing torch's ``ColwiseParallel``/``RowwiseParallel`` implement.
  Everything else (norms, embeddings, the head) stays whole on every rank of the group.
- ``tensor_parallel_plan(model)`` builds it: a module that defines ``tensor_parallel_plan()``
  declares its own (names relative to it; attention must, since only the model knows how its
  heads lie in a fused projection — the char-LM ``Block`` does); inside modules that declare
  nothing, a ``Sequential`` of ``Linear``, element-wise layers, ``Linear`` (an MLP) becomes
  colwise then rowwise, pairwise. Pure: reads the module tree. Raises ``InvalidSpec`` when the
  plan is empty (nothing to split) or names something that is not a ``Linear``, or when a
  layer's split features (or a declaring module's ``n_heads``) do not divide by the degree.
- ``apply_tensor_parallel(model, mesh, plan)`` applies it in place (``parallelize_module``) and
  returns the names it split. Collective over the mesh only through the DTensors it makes.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from torchrelay.errors import InvalidSpec

__all__ = ["apply_tensor_parallel", "tensor_parallel_plan"]

STYLES = ("colwise", "rowwise")
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU)


def _mlp_pairs(prefix: str, seq: nn.Sequential) -> dict[str, str]:
    plan: dict[str, str] = {}
    children = list(seq.named_children())
    i = 0
    while i < len(children):
        name, child = children[i]
        if isinstance(child, nn.Linear):
            j = i + 1
            while j < len(children) and isinstance(children[j][1], _ELEMENTWISE):
                j += 1
            if j < len(children) and j > i + 0 and isinstance(children[j][1], nn.Linear):
                plan[f"{prefix}{name}"] = "colwise"
                plan[f"{prefix}{children[j][0]}"] = "rowwise"
                i = j + 1
                continue
        i += 1
    return plan


def tensor_parallel_plan(model: nn.Module, degree: int = 2, *, allow_empty: bool = False) -> dict[str, str]:
    """``{linear name: "colwise" | "rowwise"}`` for ``model`` (see the module docstring). ``allow_empty``:
    ``{}`` rather than ``InvalidSpec`` for a model with nothing to split (a pipeline's embedding block)."""
    plan: dict[str, str] = {}
    declared: list[str] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if any(d == "" or name == d or name.startswith(f"{d}.") for d in declared):  # "": the root declared
            continue
        own = getattr(module, "tensor_parallel_plan", None)
        if callable(own):
            heads = getattr(module, "n_heads", None)
            if isinstance(heads, int) and heads % degree:
                raise InvalidSpec(f"tensor parallel: {name or 'the model'} has {heads} attention heads, not "
                                  f"divisible by tensor_parallel={degree}; each rank must hold whole heads")
            declared.append(name)
            plan.update({f"{prefix}{k}": v for k, v in dict(own()).items()})
        elif isinstance(module, nn.Sequential):
            plan.update(_mlp_pairs(prefix, module))
    if not plan and not allow_empty:
        raise InvalidSpec("strategy.tensor_parallel > 1 but the model has nothing to split: no module defines "
                          "tensor_parallel_plan() and no Sequential holds Linear, activation, Linear; use "
                          "tensor_parallel: 1 or declare a plan (docs/strategies.md)")
    for name, style in plan.items():
        _check(model, name, style, degree)
    return plan


def _check(model: nn.Module, name: str, style: str, degree: int) -> None:
    if style not in STYLES:
        raise InvalidSpec(f"tensor parallel plan: {name}={style!r}; use 'colwise' or 'rowwise'")
    try:
        layer = model.get_submodule(name)
    except AttributeError:
        raise InvalidSpec(f"tensor parallel plan names {name!r}, which the model does not have") from None
    if not isinstance(layer, nn.Linear):
        raise InvalidSpec(f"tensor parallel plan: {name} is a {type(layer).__name__}; only Linear layers split")
    features = layer.out_features if style == "colwise" else layer.in_features
    if features % degree:
        raise InvalidSpec(f"tensor parallel: {name} has {features} {'output' if style == 'colwise' else 'input'} "
                          f"features, not divisible by tensor_parallel={degree}")


def apply_tensor_parallel(model: nn.Module, mesh: Any, plan: dict[str, str]) -> list[str]:
    """Split ``plan``'s layers of ``model`` over ``mesh`` (1-D) in place; the names split."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    return sorted(plan)
