"""Restart or fail: who is blamed for a failed attempt, and what the job does next. Pure.

- ``blame(failed, attempt)``: the ``FailureInfo`` that explains an attempt from its failed
  launches: the rank that died first and was not stopped because of a peer, with its exit code
  or signal and its last lines.
- ``outside_the_job(failed)``: whether an attempt failed for a reason outside the job only (a
  lost node: its launches, and the peers' launches the server stopped because of them).
- ``decide_failure(failure, ...)``: a ``FailureDecision``: restart (counted against
  ``max_restarts`` or not) or fail, with the event message the job records.

No I/O, no clock: ``lifecycle`` calls these and the server carries out the decision.
"""
from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Sequence

from torchrelay.server.views import LaunchView
from torchrelay.wire import FailureInfo, RankExit


class FailureAction(str, enum.Enum):
    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureDecision:
    """What a failed attempt leads to. ``counted``: the restart uses up one of ``max_restarts``
    (a failure outside the job, such as a lost node, does not); ``message``: the job's event."""

    action: FailureAction
    counted: bool
    failure: FailureInfo
    message: str

    @property
    def blamed_rank(self) -> int | None:
        return self.failure.rank


def decide_failure(failure: FailureInfo, *, infra_only: bool, restarts: int, max_restarts: int) -> FailureDecision:
    """Restart while restarts are left, or for free when every failed launch failed for a
    reason outside the job (``infra_only``); else fail, naming the blamed rank's reason."""
    if infra_only:
        return FailureDecision(action=FailureAction.RESTART, counted=False, failure=failure,
                               message=f"{failure.reason}; restarting elsewhere (not counted against max_restarts)")
    if restarts < max_restarts:
        return FailureDecision(action=FailureAction.RESTART, counted=True, failure=failure,
                               message=f"restart {restarts + 1} of {max_restarts}: {failure.reason}")
    return FailureDecision(action=FailureAction.FAIL, counted=False, failure=failure, message=failure.reason)


def outside_the_job(failed: Sequence[LaunchView]) -> bool:
    """True when some failed launch failed for a reason outside the job (``infra``: its node
    was lost) and every other one only because the server stopped it for that (a job across
    nodes loses one: its peers' launches are stopped, which is no fault of the job)."""
    return any(x.infra for x in failed) and all(x.infra or x.stopped for x in failed)


def blame(failed: Sequence[LaunchView], attempt: int) -> FailureInfo:
    """The failing rank that explains the attempt: one that ended by itself (an exit code or a
    fault) rather than torn down by SIGTERM/SIGINT/SIGHUP or gone without an exit record, in a
    launch the server did not stop, first to die in its launch, on the lowest node; else the
    first one that did not return. ``failed`` is not empty."""
    # The agent lists a launch's failed ranks earliest death first, so a launch's first
    # failed rank is its root cause and the ones after it were torn down because of it.
    # A launch the server stopped (because a peer failed) only explains the attempt when
    # nothing else does. A rank a launcher tore down (mpirun and torchrun end a world with
    # SIGTERM when one rank fails) ranks below a rank that failed by itself on another node,
    # even when that node's launch was stopped by the time its report arrived.
    candidates: list[tuple[tuple[bool, bool, bool, int], LaunchView, RankExit]] = []
    for launch in failed:
        failed_ranks = [r for r in (RankExit.model_validate(d) for d in launch.ranks) if not r.returned]
        for position, rank in enumerate(failed_ranks):
            # torn down by a launcher, or no exit record at all (killed with its supervisor): says little
            vague = (rank.signal in _TEARDOWN_SIGNALS and not rank.reason) or \
                (rank.exit_code is None and rank.signal is None)
            candidates.append(((vague, launch.stopped, position > 0, launch.node_rank), launch, rank))
    lost = next((x for x in failed if x.infra), None)
    if lost is not None and all(launch.stopped for _, launch, _ in candidates):
        candidates = []  # the peers were stopped because a node was lost: the loss explains it
    if not candidates:
        launch = lost or failed[0]
        return FailureInfo(reason=launch.message or f"launch on node {launch.node_name} failed",
                           node=launch.node_name, attempt=attempt)
    _, launch, rank = min(candidates, key=lambda c: c[0])
    if rank.exit_code is None and rank.signal is None:
        # the rank never ran (torchrun itself failed, e.g. its rendezvous): the launch says why
        return FailureInfo(reason=f"rank {rank.rank} did not run: {launch.message or 'no exit status'}",
                           rank=rank.rank, node=launch.node_name, last_lines=rank.last_lines, attempt=attempt)
    return FailureInfo(reason=f"rank {rank.rank} {_how_it_ended(rank)}", rank=rank.rank, node=launch.node_name,
                       exit_code=rank.exit_code, signal=rank.signal, last_lines=rank.last_lines, attempt=attempt)


_TEARDOWN_SIGNALS = frozenset({int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP)})


def _how_it_ended(rank: RankExit) -> str:
    if rank.reason:  # the node ended it, e.g. "memory limit 1 GiB exceeded"
        return f"was stopped: {rank.reason}" + (f" (signal {rank.signal})" if rank.signal else "")
    if rank.signal:
        try:
            return f"was killed by {signal.Signals(rank.signal).name}"
        except ValueError:
            return f"was killed by signal {rank.signal}"
    return f"exited with code {rank.exit_code}"
