"""What to do with a heartbeat reply: the launches to start, update, stop, report and forget (pure).

The reply lists every launch the server wants on this node (``desired`` "run" or "stop"); the
agent holds some launches (each in a state, see ``LaunchState``) and remembers the ids of those
it has let go of (``done``).

Contract of ``plan_reconcile(held, done, wanted, owed)``:
- a launch wanted to run that the agent neither holds nor let go of is **started**;
- a held launch that is listed gets the listed assignment (**update**: node 0's port for the
  other nodes, the grace of a stop, which is 0 for ``cancel --no-checkpoint``);
- a held launch wanted to stop, or no longer listed, is **stopped** (idempotent for the runner);
- a launch wanted to stop that the agent never held is **reported** exited ("never started"),
  once, so that the server moves on; it then counts as let go of;
- a held launch that exited, is not wanted to run and of which nothing is ``owed`` (its lines,
  metrics and statuses all delivered) is **forgotten**: dropped from the held launches.
"""
from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from torchrelay import wire


class LaunchState(enum.Enum):
    """A held launch's state, as the heartbeat reports it (the values of ``wire.LaunchReport``)."""

    PREPARING = "preparing"
    RUNNING = "running"
    EXITED = "exited"


@dataclass(kw_only=True, slots=True)
class ReconcilePlan:
    start: list[wire.LaunchAssignment] = field(default_factory=list)
    update: list[wire.LaunchAssignment] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    never_ran: list[str] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)


def plan_reconcile(*, held: Mapping[str, LaunchState], done: Collection[str],
                   wanted: Sequence[wire.LaunchAssignment], owed: Collection[str]) -> ReconcilePlan:
    """The plan that makes the held launches what ``wanted`` asks for (see the module docstring)."""
    plan = ReconcilePlan()
    listed = {}
    for assignment in wanted:
        launch_id = assignment.launch_id
        listed[launch_id] = assignment
        if launch_id in held:
            plan.update.append(assignment)
        elif launch_id in done:
            continue
        elif assignment.desired == "run":
            plan.start.append(assignment)
        else:
            plan.never_ran.append(launch_id)
    for launch_id, state in held.items():
        assignment = listed.get(launch_id)
        if assignment is not None and assignment.desired == "run":
            continue
        plan.stop.append(launch_id)
        if state is LaunchState.EXITED and launch_id not in owed:
            plan.forget.append(launch_id)
    return plan
