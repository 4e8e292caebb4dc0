"""Which submodules FSDP shards as units (each gathered whole for its forward and backward). Pure.

``find_units(model, wrap)`` returns the dotted names of the unit modules, outermost first, and
notes saying why any were left to the root:

- ``wrap="auto"``: the children of the model when it is a ``Sequential`` or ``ModuleList``;
  otherwise the children of the first ``Sequential``/``ModuleList`` met breadth-first that has
  at least two children with parameters (a transformer's ``blocks``/``layers``). None found:
  the whole model is one unit (the root) and a note says so.
- ``wrap=("Block", ...)``: every submodule whose class name is listed, except those inside
  another match (FSDP units nest, but a unit inside a unit gains nothing here).
- Either way a unit that shares a parameter with a module outside it (tied embedding and
  output weights) is dropped, with a note: FSDP2 shards each parameter in one unit, and the
  root, which holds what no unit took, is the only place both users see it gathered.
  A unit without parameters of its own is dropped silently.

Reads the module tree only (names, classes, parameter identities); never runs the model.
"""
from __future__ import annotations

from collections import deque

from torch import nn

from torchrelay.errors import InvalidSpec

__all__ = ["find_units"]


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _auto(model: nn.Module) -> list[str]:
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return [name for name, child in model.named_children() if _has_params(child)]
    queue: deque[tuple[str, nn.Module]] = deque(model.named_children())
    while queue:
        name, module = queue.popleft()
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            children = [f"{name}.{c}" for c, child in module.named_children() if _has_params(child)]
            if len(children) >= 2:
                return children
        queue.extend((f"{name}.{c}", child) for c, child in module.named_children())
    return []


def _by_class(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    known = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in known]
    if missing:
        raise InvalidSpec(f"strategy.wrap names {missing} but the model has no module of that class; "
                          f"its classes are {sorted(known)}")
    out: list[str] = []
    for name, module in model.named_modules():
        if name and type(module).__name__ in names and not any(name.startswith(f"{u}.") for u in out):
            out.append(name)
    return out


def _shares_outside(model: nn.Module, unit: str) -> bool:
    inside = {id(p) for p in model.get_submodule(unit).parameters()}
    for name, module in model.named_modules():
        if name == unit or name.startswith(f"{unit}.") or unit.startswith(f"{name}.") or not name:
            continue
        if any(id(p) in inside for p in module.parameters(recurse=False)):
            return True
    return any(id(p) in inside for p in model.parameters(recurse=False))


def find_units(model: nn.Module, wrap: str | tuple[str, ...] = "auto") -> tuple[list[str], list[str]]:
    """(unit names, notes) of ``model`` for ``wrap`` (see the module docstring). Raises ``InvalidSpec``
    for a class name the model does not have."""
    candidates = _auto(model) if wrap == "auto" else _by_class(model, tuple(wrap))
    units, notes = [], []
    for unit in candidates:
        if not _has_params(model.get_submodule(unit)):
            continue
        if _shares_outside(model, unit):
            notes.append(f"{unit} ({type(model.get_submodule(unit)).__name__}) shares a parameter with a "
                         "module outside it: sharded with the root")
            continue
        units.append(unit)
    if not units:
        notes.append("no repeated blocks found: the whole model is one unit (set strategy.wrap to class names)")
    return units, notes
