"""Elastic data parallel's decisions: who the members of the next epoch are, where training
resumes, whose state the others take, and which samples a member trains at a step. Pure: no
torch.distributed, no clock, no I/O (``torchrelay.train.elastic`` carries them out).

- A ``Membership`` is one membership epoch: its number, the first step trained with it and its
  members (ids, sorted; a member's rank in the epoch is its index).
- ``after_failure(current, committed, min_workers)``: the members that reached the re-formation
  (``committed``: member -> the number of steps it completed) form the next epoch; it starts at
  the fewest steps any of them completed (``resume_step``), since a collective that failed may
  have completed for some members and not for others. Raises ``TooFewMembers``.
- ``state_source(committed)``: the member whose in-memory state everyone takes after a
  re-formation: one that completed the fewest steps (ties to the lowest id), so every member
  goes on from the same step with the same parameters and optimizer state.
- ``after_join(current, joiners, max_workers, next_step)``: the members plus as many of the
  waiting joiners (in arrival order) as ``max_workers`` allows, from ``next_step``.
- ``member_range(num_samples, global_batch, step, members, member)``: the ``(start, stop)`` of
  the epoch's order that ``member`` trains at ``step``: equal shares of the global batch
  (``shares.step_split``), so the global batch stays the same whatever the membership and
  every sample of the epoch is trained exactly once, also across membership changes.
- ``keeps_own_state(own_sync_step, source_sync_step)``: local SGD / DiLoCo
  (``torchrelay.train.elastic_sync``): after a change, whether a member goes on from its own
  state at its last sync point (True: it is the point everyone resumes from, and its inner
  optimizer state is its own) or takes the source member's (a joiner, None; or a member for
  which the last sync completed while it failed for the others).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchrelay.train.shares import proportional_shares, step_split

__all__ = ["Membership", "TooFewMembers", "after_failure", "after_join", "keeps_own_state", "member_range",
           "resume_step", "state_source"]


class TooFewMembers(RuntimeError):
    """Fewer members are left than the job's ``min_workers``."""


@dataclass(frozen=True, slots=True)
class Membership:
    epoch: int
    start_step: int
    members: tuple[int, ...]

    def rank_of(self, member: int) -> int:
        """The member's rank in this epoch. Raises ``ValueError`` when it is not a member."""
        if member not in self.members:
            raise ValueError(f"member {member} is not in epoch {self.epoch}'s members {list(self.members)}")
        return self.members.index(member)

    def to_json(self) -> dict:
        return {"epoch": self.epoch, "start_step": self.start_step, "members": list(self.members)}

    @classmethod
    def from_json(cls, data: Mapping) -> "Membership":
        return cls(int(data["epoch"]), int(data["start_step"]), tuple(sorted(int(m) for m in data["members"])))


def resume_step(committed: Mapping[int, int]) -> int:
    """The step training goes on from: the fewest steps any member completed."""
    if not committed:
        raise TooFewMembers("no member reached the re-formation")
    return min(committed.values())


def state_source(committed: Mapping[int, int]) -> int:
    """The member whose state the others take (the fewest steps completed, then the lowest id)."""
    return min(committed, key=lambda member: (committed[member], member))


def after_failure(current: Membership, committed: Mapping[int, int], min_workers: int) -> Membership:
    """The next epoch after a failed collective, of the members in ``committed``."""
    survivors = tuple(sorted(m for m in committed if m in current.members))
    if len(survivors) < min_workers:
        raise TooFewMembers(f"{len(survivors)} of epoch {current.epoch}'s members {list(current.members)} are "
                            f"left ({list(survivors)}), fewer than min_workers={min_workers}")
    return Membership(current.epoch + 1, resume_step({m: committed[m] for m in survivors}), survivors)


def after_join(current: Membership, joiners: Sequence[int], max_workers: int, next_step: int) -> Membership:
    """The next epoch with the waiting ``joiners`` admitted (first come, up to ``max_workers``)."""
    room = max(0, max_workers - len(current.members))
    admitted = [j for j in joiners if j not in current.members][:room]
    return Membership(current.epoch + 1, next_step, tuple(sorted((*current.members, *admitted))))


def member_range(num_samples: int, global_batch: int, step: int, members: Sequence[int],
                 member: int) -> tuple[int, int]:
    """``member``'s ``(start, stop)`` into the epoch's order at ``step`` (0-based in the epoch).
    Raises ``ValueError`` for a member not in ``members`` or a step past the epoch."""
    ordered = sorted(members)
    if member not in ordered:
        raise ValueError(f"member {member} is not among {ordered}")
    shares = proportional_shares([1.0] * len(ordered), global_batch)
    return step_split(num_samples, global_batch, step, shares)[ordered.index(member)]


def keeps_own_state(own_sync_step: int | None, source_sync_step: int) -> bool:
    """Whether a member keeps its own sync-point state after a change (see the module docstring):
    it has one (not a joiner) and it is at the step everyone resumes from (the source's)."""
    return own_sync_step is not None and own_sync_step == source_sync_step
