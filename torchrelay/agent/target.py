"""What a worker runs, as a typed value: a hosted script or module, Python code, or a program.

Contract (pure, standard library only: the worker process imports this module):
- ``WORKER_MODULE`` is the exit hook's module (``python -m torchrelay.agent.worker``).
- ``WorkerTarget(kind=..., target=..., args=...)``: ``TargetKind.SCRIPT`` (``python SCRIPT ARGS``),
  ``MODULE`` (``python -m MODULE ARGS``), ``CODE`` (``python -c CODE ARGS``, run by ``interpreter``)
  or ``PROGRAM`` (any other command line, ``target`` being the program).
- ``target_of_entrypoint(entrypoint, python)`` reads a job's entrypoint: ``python``/``python3``/
  ``python3.X`` with a script or ``-m`` (``-u`` dropped: workers are unbuffered anyway) is hosted;
  ``python -c CODE`` is code; any other ``python`` command line (other flags, bare ``python``) is a
  program run by ``python`` (the agent's interpreter) when given; anything else a program as is.
  Raises ``ValueError`` on an empty entrypoint.
- ``target_of_worker_argv(argv)`` reads the worker's own command line (``SCRIPT ARGS``,
  ``-m MODULE ARGS``, ``-mMODULE``, ``--exec PROGRAM ARGS``); raises ``UsageError``.
- ``WorkerTarget.worker_argv()`` is the inverse: the arguments after ``-m WORKER_MODULE``.
- ``WorkerTarget.hosted``: whether the exit hook runs it in-process (a script or a module).
"""
from __future__ import annotations

import enum
import os
import re
from collections.abc import Sequence

WORKER_MODULE = "torchrelay.agent.worker"
USAGE = ("usage: python -m torchrelay.agent.worker SCRIPT.py ARGS... | -m MODULE ARGS... "
         "| --exec PROGRAM ARGS...")
_PYTHON = r"^python(\d+(\.\d+)?)?$"  # compiled on first use (``re`` caches it): only the agent reads entrypoints


class UsageError(ValueError):
    """The worker's own command line is malformed (names what was given)."""


class TargetKind(enum.Enum):
    """How a target runs; the values are the zygote's request kinds ("exec": the worker's ``--exec``)."""

    SCRIPT = "script"
    MODULE = "module"
    CODE = "code"
    PROGRAM = "exec"


class WorkerTarget:
    """What a worker runs. Immutable, compared by value.

    A plain class rather than a dataclass: every worker process imports this module when it
    starts, and ``dataclasses`` (with ``inspect``) would add about 9 ms of import to each.
    """

    __slots__ = ("kind", "target", "args", "interpreter")

    def __init__(self, *, kind: TargetKind, target: str, args: Sequence[str] = (), interpreter: str = "python"):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "interpreter", interpreter)  # what runs CODE (``python -c``)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"WorkerTarget is immutable; cannot set {name}")

    def _key(self) -> tuple:
        return self.kind, self.target, self.args, self.interpreter

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WorkerTarget) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return (f"WorkerTarget(kind={self.kind}, target={self.target!r}, args={self.args!r}, "
                f"interpreter={self.interpreter!r})")

    @property
    def hosted(self) -> bool:
        """Whether the exit hook runs it in its own process (a script or a module)."""
        return self.kind in (TargetKind.SCRIPT, TargetKind.MODULE)

    def program_argv(self) -> list[str]:
        """The command line of a target that is not hosted (``CODE`` or ``PROGRAM``)."""
        if self.kind is TargetKind.CODE:
            return [self.interpreter, "-c", self.target, *self.args]
        if self.kind is TargetKind.PROGRAM:
            return [self.target, *self.args]
        raise ValueError(f"a {self.kind.value} target is hosted by the worker, not run as a program")

    def worker_argv(self) -> list[str]:
        """Arguments for ``python -m WORKER_MODULE`` that run this target."""
        if self.kind is TargetKind.SCRIPT:
            return [self.target, *self.args]
        if self.kind is TargetKind.MODULE:
            return ["-m", self.target, *self.args]
        return ["--exec", *self.program_argv()]


def target_of_entrypoint(entrypoint: Sequence[str], python: str | None = None) -> WorkerTarget:
    """The target a job's ``entrypoint`` names (see the module docstring)."""
    argv = list(entrypoint)
    if not argv or not argv[0]:
        raise ValueError(f"entrypoint {entrypoint!r} is empty; give e.g. ['python', 'train.py']")
    if not re.match(_PYTHON, os.path.basename(argv[0])):
        return WorkerTarget(kind=TargetKind.PROGRAM, target=argv[0], args=tuple(argv[1:]))
    interpreter = python or argv[0]
    if len(argv) >= 3 and argv[1] == "-c":
        return WorkerTarget(kind=TargetKind.CODE, target=argv[2], args=tuple(argv[3:]), interpreter=interpreter)
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return WorkerTarget(kind=TargetKind.MODULE, target=rest[1], args=tuple(rest[2:]))
    if rest and not rest[0].startswith("-"):
        return WorkerTarget(kind=TargetKind.SCRIPT, target=rest[0], args=tuple(rest[1:]))
    # `python -O x.py`, `python -u -c ...`, bare `python`: not a script the hook can host
    return WorkerTarget(kind=TargetKind.PROGRAM, target=interpreter, args=tuple(argv[1:]))


def target_of_worker_argv(argv: Sequence[str]) -> WorkerTarget:
    """The target of the worker's own command line (without the program name)."""
    if not argv:
        raise UsageError(f"no script given; {USAGE}")
    head = argv[0]
    if head in ("-m", "--exec"):
        if len(argv) < 2 or not argv[1]:
            raise UsageError(f"{head} needs a {'module' if head == '-m' else 'program'}; {USAGE}")
        kind = TargetKind.MODULE if head == "-m" else TargetKind.PROGRAM
        return WorkerTarget(kind=kind, target=argv[1], args=tuple(argv[2:]))
    if head.startswith("-m") and len(head) > 2:  # `-mpkg.mod`, as python accepts it
        return WorkerTarget(kind=TargetKind.MODULE, target=head[2:], args=tuple(argv[1:]))
    if head.startswith("-"):
        raise UsageError(f"unknown option {head!r}; {USAGE}")
    return WorkerTarget(kind=TargetKind.SCRIPT, target=head, args=tuple(argv[1:]))
