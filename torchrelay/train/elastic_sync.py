"""Elastic local SGD and DiLoCo: ``strategy: {kind: local_sgd | diloco, elastic: {min_workers, max_workers}}``.

The replicas agree only at sync points (local SGD's parameter average, DiLoCo's outer step,
and every step of local SGD's gradient-averaging warm-up); in between each trains alone and
nothing is exchanged. So the unit of agreement is the *period* between two sync points, as
the step is for elastic DDP (``torchrelay.train.elastic``, whose membership epochs, store and
gloo groups this reuses; the rules are ``torchrelay.train.sync``'s, unchanged):

- **Every member keeps its state at the last sync point** (its *anchor*: the parameters, equal
  on every member there, DiLoCo's global parameters and outer momentum, equal too, its own
  inner optimizer state and buffers, and the step). That is one copy of the model and of the
  optimizer state per member: the price of elasticity between sync points.
- **A member dies** between sync points: nobody notices until the next collective (the next
  sync point), which fails on the others. They re-form as elastic DDP does, recording their
  anchor's step, go back to their anchors and redo the period with the members alive, the
  global batch of each step split among them. The dead member's updates since the last sync
  existed only in its memory, so the period's samples it trained are trained again by the
  survivors: every sample of an epoch is in the final parameters exactly once, at the cost of
  redoing at most ``every`` steps. (A member for which the failed sync completed while it
  failed for others has a later anchor: everyone goes back to the earliest one, that member
  taking the source's state; ``elastic_plan.keeps_own_state``.)
- **A joiner** is admitted at a sync point: the waiting joiners' count rides in the sync's
  all-reduce (no extra collective), and right after that step the members form the next
  epoch with it. It receives the source member's anchor, which is the state at that sync
  point: the averaged (global) parameters, DiLoCo's outer optimizer state, the step and the
  schedule's position (the rules' state), and the source's inner optimizer state. The
  members keep their own inner state.

Contract:
- ``ElasticSync(group, model, optimizer, strategy=None)``: ``group`` an ``ElasticGroup`` (from
  ``from_env`` or ``join``); ``strategy`` a local_sgd or diloco strategy (spec model or dict),
  by default ``RELAY_STRATEGY``'s. Collective: members started with the job take member 0's
  state (as ``sync.prepare`` broadcasts rank 0's); a joiner blocks until it has the source's.
  Raises ``InvalidSpec`` for another kind or an optimizer that misses trainable parameters.
- ``step()``: the inner optimizer's step and, at a sync point, the sync; False when the
  membership changed: the state is then the last sync point's and ``steps_done`` is where to
  go on (the caller recomputes its batch from it). Also admits joiners after a sync.
- ``finished(total_steps) -> bool``: False while ``steps_done < total_steps``; then averages
  the last, partial period (``sync.finish``): False if a member left in it (redo from
  ``steps_done``), True when the replicas are equal and training is over.
- ``steps_done``, ``optimizer`` (the ``sync.SyncOptimizer``: ``state_dict``, ``metrics``),
  ``group``, ``anchor_step`` (the last sync point's step).
- Each member's loss is its own samples' mean (its step is local), not the global batch's.
  ``balance: throughput`` does not apply (the shares are equal: ``group.batch_range``).
"""
from __future__ import annotations

import copy
import os
from typing import Any

import torch
from pydantic import ValidationError

from torchrelay.errors import InvalidSpec
from torchrelay.spec import DiLoCoStrategy, LocalSGDStrategy, describe_validation_error
from torchrelay.train.elastic import ElasticGroup
from torchrelay.train.elastic_plan import keeps_own_state
from torchrelay.train.environment import parse_strategy, validate_strategy
from torchrelay.train.sync import Collective, GradientAverage, SyncOptimizer, build_rules

__all__ = ["ElasticSync", "MembershipChanged"]

ELASTIC_SYNC_KINDS = ("local_sgd", "diloco")


class MembershipChanged(RuntimeError):
    """A collective failed and the group re-formed (``ElasticSync`` goes back to its anchor)."""


class _GroupCollective(Collective):
    """``sync.Collective`` over the elastic group's current epoch: the mean over its members.
    Always communicates, also for one member (the all-reduce carries the joiners' count)."""

    def __init__(self, group: ElasticGroup, anchor_step) -> None:
        super().__init__(group.size)
        self.group = group
        self.anchor_step = anchor_step  # () -> int: what a re-formation records for this member

    def average_(self, flat: torch.Tensor, of: str = "parameters") -> torch.Tensor:
        self.count(flat.numel() * flat.element_size())
        with self.clock.in_collective():
            summed = self.group.all_reduce_(flat, self.anchor_step())
        if not summed:
            raise MembershipChanged(f"the membership changed; epoch {self.group.membership.epoch} resumes "
                                    f"from step {self.group.membership.start_step}")
        self.world_size = self.group.size
        return flat.div_(self.group.size)

    def broadcast_(self, tensors, src: int = 0, counted: bool = True) -> None:
        raise NotImplementedError("elastic sync states travel through ElasticGroup.sync_state")


def _elastic_strategy(strategy: Any) -> LocalSGDStrategy | DiLoCoStrategy:
    if strategy is None:
        strategy = parse_strategy(os.environ.get("RELAY_STRATEGY"))
    elif isinstance(strategy, dict):
        try:
            strategy = validate_strategy(strategy)
        except ValidationError as exc:
            raise InvalidSpec(describe_validation_error(exc).replace("spec", "strategy", 1)) from None
    if not isinstance(strategy, (LocalSGDStrategy, DiLoCoStrategy)):
        kind = getattr(strategy, "kind", type(strategy).__name__)
        raise InvalidSpec(f"ElasticSync runs strategy kinds {', '.join(ELASTIC_SYNC_KINDS)}, not {kind!r}; "
                          "elastic ddp uses ElasticGroup.all_reduce_gradients (docs/elastic.md)")
    return strategy


class ElasticSync:
    """One member's local SGD or DiLoCo over an ``ElasticGroup`` (see the module docstring)."""

    def __init__(self, group: ElasticGroup, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 strategy: Any = None) -> None:
        strategy = _elastic_strategy(strategy)
        self.group, self.model = group, model
        params = [p for p in model.parameters() if p.requires_grad]
        optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [i for i, p in enumerate(params) if id(p) not in optimized]
        if missing:
            raise InvalidSpec(f"{len(missing)} trainable parameters of the model (indices {missing[:5]}) are "
                              "not in the optimizer; pass an optimizer over model.parameters()")
        self.comm = _GroupCollective(group, lambda: self.anchor_step)
        self.rules = build_rules(strategy, params, self.comm)
        self.optimizer = SyncOptimizer(optimizer, kind=strategy.kind, rules=self.rules, comm=self.comm, model=model)
        joiner = group.needs_sync  # ElasticGroup.join: admitted, its state still to come
        self._anchor: dict | None = None if joiner else self._snapshot()
        received = group.sync_state(self._anchor)  # the job's first members: member 0's, as prepare's broadcast
        self._take(received, keep_own=False)

    @property
    def steps_done(self) -> int:
        return self.optimizer.steps_done

    @property
    def anchor_step(self) -> int:
        """The step of this member's last sync point."""
        return int(self._anchor["opt"]["sync"]["steps_done"]) if self._anchor is not None else -1

    # ------------------------------------------------------------ training

    def step(self) -> bool:
        """The local step and what the strategy does at it; False when the membership changed
        (the state went back to the last sync point: go on from ``steps_done``)."""
        try:
            self.optimizer.step()
        except MembershipChanged:
            self._resync()
            return False
        if self._at_sync_point():
            self._anchor = self._snapshot()
        self.group.step_done(self.steps_done)
        if self.group.needs_sync:  # joiners admitted: only after a collective, so at a sync point
            if self.anchor_step != self.steps_done:
                raise AssertionError(f"joiners admitted at step {self.steps_done}, not a sync point "
                                     f"(the last was {self.anchor_step})")
            self._resync()
        return True

    def finished(self, total_steps: int) -> bool:
        """Whether training is over at ``total_steps``: averages the last period first (collective);
        False if a member left in it (the state went back to the last sync point)."""
        if self.steps_done < total_steps:
            return False
        try:
            self.optimizer.finish()
        except MembershipChanged:
            self._resync()
            return False
        return True

    # ------------------------------------------------------------ state

    def _at_sync_point(self) -> bool:
        """Whether the replicas are equal after this step (every synchronising rule just synced)."""
        return all(rule.synced_at == self.steps_done for rule in self.rules if not isinstance(rule, GradientAverage))

    def _snapshot(self) -> dict:
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "opt": copy.deepcopy(self.optimizer.state_dict())}

    def _resync(self) -> None:
        """After a change: everyone goes on from the source's sync point (see the module docstring)."""
        received = self.group.sync_state(self._anchor)
        source_step = int(received["opt"]["sync"]["steps_done"])
        own = self._anchor is not None and keeps_own_state(self.anchor_step, source_step)
        self._take(received, keep_own=own)

    @torch.no_grad()
    def _take(self, received: dict, *, keep_own: bool) -> None:
        state = self._anchor if keep_own else received
        live = copy.deepcopy(state)  # the anchor stays untouched by the steps that follow
        self.model.load_state_dict(live["model"])
        self.optimizer.load_state_dict(live["opt"])
        self._anchor = state
