"""How a launch ended, from its ranks' markers: per-rank exits, the verdict and its message (pure).

Contract:
- ``classify_exit(ranks, markers, last_lines)``: a ``wire.RankExit`` per rank and whether the
  launch succeeded (every rank's script returned; an abort during teardown after that still
  counts). Order: failed ranks first, earliest failure first (the root cause before the ranks
  torn down because of it), then the others by rank.
- ``no_exit_record(exits)``: no rank left a marker (the launch's first process died, or never
  started its workers): only then does the message quote that process's own log.
- ``exit_message(...)``: the one-line summary a ``wire.LaunchStatus`` carries.
- ``describe_rank``: ``'rank 1: exit code 3'``, ``'rank 0: signal 9 (SIGKILL)'``.
"""
from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence

from torchrelay import wire

LAST_LINES = 20


def describe_rank(exit_: wire.RankExit) -> str:
    """Short human form: 'rank 1: exit code 3', 'rank 0: signal 9 (SIGKILL)'."""
    if exit_.returned:
        how = "returned"
        if exit_.signal is not None:
            how += f" (then signal {exit_.signal} during shutdown)"
    elif exit_.signal is not None:
        how = f"signal {exit_.signal} ({_signal_name(exit_.signal)})"
        if exit_.reason:  # the node ended it: 'memory limit 1 GiB exceeded (signal 9, SIGKILL)'
            how = f"{exit_.reason} (signal {exit_.signal}, {_signal_name(exit_.signal)})"
    elif exit_.exit_code is not None:
        how = f"exit code {exit_.exit_code}"
    else:
        how = "no exit record (never started or killed with its supervisor)"
    return f"rank {exit_.rank}: {how}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown signal"


def classify_exit(ranks: Sequence[int], markers: Mapping[int, dict],
                  last_lines: Mapping[int, Sequence[str]]) -> tuple[list[wire.RankExit], bool]:
    """Per-rank exits and whether the launch succeeded.

    ``markers`` maps a global rank to its worker marker (see ``torchrelay.agent.worker``);
    a missing one means the rank never ended through the hook.
    """
    exits = []
    for rank in ranks:
        marker = markers.get(rank) or {}
        exits.append((marker.get("ended_at"), wire.RankExit(
            rank=rank,
            exit_code=marker.get("exit_code"),
            signal=marker.get("signal"),
            returned=bool(marker.get("returned")),
            last_lines=list(last_lines.get(rank, ()))[-LAST_LINES:],
        )))
    failed = [(t, e) for t, e in exits if not e.returned]
    failed.sort(key=lambda pair: (pair[0] is None, pair[0] or 0.0, pair[1].rank))
    others = [e for _, e in exits if e.returned]
    return [e for _, e in failed] + others, bool(exits) and not failed


def no_exit_record(exits: Sequence[wire.RankExit]) -> bool:
    """Whether no rank said how it ended."""
    return all(r.exit_code is None and r.signal is None for r in exits)


def exit_message(exits: Sequence[wire.RankExit], *, succeeded: bool, started: bool, stopped: bool,
                 unstarted: str, first_process: str, returncode: int | None,
                 launcher_tail: Sequence[str] = ()) -> str:
    """The summary of a finished launch. ``unstarted`` is the message of a launch stopped
    before it started; ``first_process`` names what it started ("torchrun", "the worker"),
    whose ``returncode`` and last log lines (``launcher_tail``) are quoted when no rank left
    an exit record."""
    if succeeded:
        return f"all {len(exits)} ranks returned"
    if not started:
        return unstarted
    message = "; ".join([describe_rank(r) for r in exits if not r.returned][:4])
    if stopped:
        message = "stopped: " + message
    if no_exit_record(exits):
        message += f"; {first_process} exited with {returncode}: " + " | ".join(launcher_tail)
    return message
