"""Warm multi-rank launches: every rank of a launch forked from the agent's warm zygote.

Why: a torchrun launch pays for torchrun's interpreter and for every worker's ``import torch``
(about 1.5 s of CPU each); a warm zygote (``zygote.Zygote(preload=("torch",))``) did that once,
and a fork costs milliseconds. An unchanged torchrun script must not tell the difference, so
the launch keeps torchrun's contract:

- **Environment**: each rank gets what torchrun's ``LocalElasticAgent`` gives it with static
  rendezvous (``commands.build_rank_env``), with ``TORCHELASTIC_USE_AGENT_STORE=True`` and the
  store hosted outside the ranks, as torchrun's agent hosts it: on node 0 the zygote forks a
  store host (``Zygote.spawn_store``) on ``MASTER_PORT`` before the ranks; and
  ``TORCHELASTIC_ERROR_FILE`` (``errors/rank-R.json`` in the run folder, where ``@record``
  writes a rank's uncaught exception). Tested against a real torchrun launch's environment.
- **Supervision and exit**: each rank is a ``backends.ZygoteBackend`` of its own rank (the
  agent's thread is its supervisor: the rank log, the marker, ``returned``, the abort-after-
  return rule, as for a direct launch). As torchrun with ``--max-restarts 0``: when a rank
  fails (its script did not return), the other ranks get SIGTERM and SIGKILL after
  ``shutdown_timeout_s``; the launch ends when every rank ended, then the store host is killed.
  An elastic job's launch (``elastic_min_workers``) leaves the peers of a failed rank running:
  they go on without it (``torchrelay.train.elastic``).
  Each rank is its own session (process group), signalled as a group by ``signal``;
  ``release(ranks, grace_s)`` ends some ranks only (SIGTERM, SIGKILL after ``grace_s``): the
  server shrank an elastic job, whose other ranks go on.
- **Fallback**: where a fork cannot be used (``warm_refusal``: a program rather than Python, a
  different interpreter, a job that sets a start-up or threading variable differently from the
  zygote, ``RELAY_FRESH_INTERPRETER=1`` in its env) or the zygote refuses (e.g. a CUDA context
  exists in it), the launch runs through torchrun (``backends.TorchrunBackend``) and ``note``
  says why (the agent reports it with the ``running`` status; the server records it as an
  event of the job). A zygote that fails after some ranks were forked: those are killed and
  reaped first, so torchrun finds the port and the folders as they were.

- **Finding the ranks**: a forked rank's ``/proc/PID/environ`` and command line are the
  zygote's, so ``ranks.json`` in the run folder names each rank's pid (and the store's); a
  rank's ``/proc/PID/cwd`` is the launch's ``code`` folder, next to it.

Contract: ``WarmBackend(place, zygote)`` is a ``backends.LaunchBackend`` (``start`` does not
block; ``poll``/``wait``/``signal``/``leftover_groups``). ``forked`` is true when the ranks were
forked. ``warm_refusal`` and ``warm_rank_env`` are pure.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

from torchrelay import wire
from torchrelay.agent import worker
from torchrelay.agent.backends import (BackendKind, LaunchBackend, LaunchPlace, TorchrunBackend, ZygoteBackend,
                                       _Spawned)
from torchrelay.agent.cgroups import CgroupError
from torchrelay.agent.commands import build_rank_env
from torchrelay.agent.processes import signal_group
from torchrelay.agent.target import WorkerTarget, target_of_entrypoint
from torchrelay.agent.zygote import Zygote, ZygoteError, refusal

log = logging.getLogger(__name__)

FRESH_VARIABLE = "RELAY_FRESH_INTERPRETER"  # a job's env: "1" asks for fresh interpreters (torchrun)


def elastic_min_workers(env: Mapping[str, str]) -> int | None:
    """``min_workers`` of the launch's elastic strategy (``RELAY_STRATEGY``), None when it is not
    elastic (pure). An elastic launch's failed rank does not end its peers, who go on without it."""
    try:
        elastic = json.loads(env.get("RELAY_STRATEGY") or "{}").get("elastic")
        return int(elastic["min_workers"]) if elastic else None
    except (ValueError, AttributeError, TypeError, KeyError):
        return None


def warm_refusal(target: WorkerTarget, env: Mapping[str, str], *, python: str, zygote_python: str,
                 zygote_env: Mapping[str, str]) -> str | None:
    """Why the ranks of a launch of ``target`` with ``env`` cannot be forked from a warm zygote
    (pure); None when they can."""
    if env.get(FRESH_VARIABLE, "0") not in ("", "0"):
        return f"the job asks for fresh interpreters ({FRESH_VARIABLE}={env[FRESH_VARIABLE]})"
    return refusal(target, env, python=python, zygote_python=zygote_python, zygote_env=zygote_env, threads=True)


def warm_rank_env(assignment: wire.LaunchAssignment, *, master_addr: str, master_port: int, rank: int,
                  error_file: str) -> dict[str, str]:
    """What torchrun's agent gives ``rank`` (pure): ``build_rank_env`` with the agent's store."""
    return {**build_rank_env(assignment, master_addr=master_addr, master_port=master_port, rank=rank),
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_ERROR_FILE": error_file}


class _WarmRank(ZygoteBackend):
    """One rank of a warm launch: forked or nothing (a refusal raises ``ZygoteError``)."""

    def rank_env(self, master_addr: str, master_port: int) -> dict[str, str]:
        error_file = self.place.run_dir / "errors" / f"rank-{self.rank}.json"
        return warm_rank_env(self.place.assignment, master_addr=master_addr, master_port=master_port,
                             rank=self.rank, error_file=str(error_file))

    def _spawn(self, env, stdout, stderr, launch_log):
        pid = self.zygote.spawn(self.target, env=env, cwd=str(self.place.code_dir), stdout=stdout, stderr=stderr)
        self._joined(pid)
        launch_log.write(f"rank {self.rank}: forked by the warm zygote, pid {pid}\n".encode())
        self.forked = True
        return _Spawned(pid, self.zygote.wait_status)

    def _joined(self, pid: int) -> None:
        try:
            self.place.join(pid)
        except CgroupError:
            os.killpg(pid, signal.SIGKILL)  # never let it run outside its limits
            self.zygote.wait_status(pid, True)
            raise

    def failed(self) -> bool:
        """Whether the rank ended without its script returning (call once it ended)."""
        marker = worker.read_marker(self.marker)
        return not (marker and marker.get("returned"))


class WarmBackend(LaunchBackend):
    kind = BackendKind.WARM
    log_name = "launch.log"
    first_process = "the workers"
    unstarted = "stopped before it started"

    def __init__(self, place: LaunchPlace, zygote: Zygote, *, shutdown_timeout_s: float = 10.0,
                 stop_peers_on_failure: bool = True):
        super().__init__(place)
        self.zygote = zygote
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop_peers_on_failure = stop_peers_on_failure  # False for an elastic job: survivors go on
        self.target = target_of_entrypoint(place.assignment.entrypoint, place.python)
        first = place.assignment.rank_offset
        self.ranks = [_WarmRank(place, zygote, rank) for rank in range(first, first + place.assignment.nproc_per_node)]
        self.store_pid: int | None = None
        self.fallback: TorchrunBackend | None = None
        self._exited = threading.Event()

    @property
    def log_path(self):
        return self.fallback.log_path if self.fallback is not None else super().log_path

    def start(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        reason = warm_refusal(self.target, env, python=self.place.python, zygote_python=self.zygote.python,
                              zygote_env=self.zygote.env)
        if reason is None:
            try:
                self._start_warm(env, master_addr, master_port)
                return
            except (ZygoteError, CgroupError) as exc:
                self._abandon()
                reason = f"the warm zygote could not fork the ranks: {exc}"
        self._fall_back(reason, env, master_addr, master_port)

    def _start_warm(self, env: dict[str, str], master_addr: str, master_port: int) -> None:
        (self.place.run_dir / "errors").mkdir(parents=True, exist_ok=True)
        if self.place.assignment.node_rank == 0:
            with open(super().log_path, "ab") as launch_log:
                self.store_pid = self.zygote.spawn_store(master_addr, master_port, env=env,
                                                         cwd=str(self.place.code_dir), stdout=launch_log.fileno(),
                                                         stderr=launch_log.fileno())
            self.ranks[0]._joined(self.store_pid)
        for rank in self.ranks:
            rank.start(env, master_addr, master_port)
        self.pid = self.ranks[0].pid
        self.forked = True
        self._write_ranks()
        self.note = f"{len(self.ranks)} ranks forked from the warm zygote (no torchrun)"
        threading.Thread(target=self._watch, name=f"relay-warm-{self.place.assignment.launch_id}",
                         daemon=True).start()

    def _write_ranks(self) -> None:
        """``ranks.json`` in the run folder: which pid is which rank. A forked rank's
        ``/proc/PID/environ`` shows the zygote's start environment, not the job's, so tools that
        find a job's processes by their environment (and people) look here."""
        assignment = self.place.assignment
        record = {"job_id": assignment.job_id, "attempt": assignment.attempt, "launch_id": assignment.launch_id,
                  "ranks": {str(r.rank): r.pid for r in self.ranks}, "store": self.store_pid}
        tmp = self.place.run_dir / "ranks.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.place.run_dir / "ranks.json")

    def _abandon(self) -> None:
        """Kill and reap whatever was forked before the zygote failed (the fallback starts clean)."""
        for rank in self.ranks:
            if rank.pid is not None:
                rank.signal(signal.SIGKILL)
                rank.wait(None)
        self._end_store()
        for rank in self.ranks:
            try:
                os.remove(rank.marker)
            except FileNotFoundError:
                pass

    def _fall_back(self, reason: str, env: dict[str, str], master_addr: str, master_port: int) -> None:
        self.note = f"started through torchrun: {reason}"
        log.info("launch %s: %s", self.place.assignment.launch_id, self.note)
        self.fallback = TorchrunBackend(self.place)
        with open(self.fallback.log_path, "ab") as out:
            out.write(f"torchrelay: not forked warm: {reason}\n".encode())
        self.fallback.start(env, master_addr, master_port)
        self.pid = self.fallback.pid

    def _watch(self) -> None:
        """torchrun's monitor loop: a failed rank ends its peers; the launch ends with the last."""
        try:
            pending = list(self.ranks)
            stopping_since: float | None = None
            while pending:
                for rank in [r for r in pending if r.poll()]:
                    pending.remove(rank)
                    if rank.failed() and self.stop_peers_on_failure and stopping_since is None:
                        stopping_since = time.monotonic()
                        for peer in pending:
                            peer.signal(signal.SIGTERM)
                if stopping_since is not None and time.monotonic() - stopping_since > self.shutdown_timeout_s:
                    for peer in pending:
                        peer.signal(signal.SIGKILL)
                if pending:
                    pending[0].wait(0.05)
            failed = [r for r in self.ranks if r.failed()]
            self.returncode = (failed[0].returncode or 1) if failed else 0
        finally:
            self._end_store()
            self._exited.set()

    def _end_store(self) -> None:
        if self.store_pid is not None:
            signal_group(self.store_pid, signal.SIGKILL)
            self.zygote.wait_status(self.store_pid, True)
            self.store_pid = None

    def poll(self) -> bool:
        if self.fallback is not None:
            done = self.fallback.poll()
            self.returncode = self.fallback.returncode
            return done
        return self._exited.is_set()

    def wait(self, timeout: float | None) -> bool:
        if self.fallback is not None:
            done = self.fallback.wait(timeout)
            self.returncode = self.fallback.returncode
            return done
        return self._exited.wait(timeout)

    def signal(self, sig: int) -> None:
        if self.fallback is not None:
            self.fallback.signal(sig)
            return
        for rank in self.ranks:
            rank.signal(sig)

    def release(self, ranks: list[int], grace_s: float) -> bool:
        """End ``ranks`` (global) only: SIGTERM now, SIGKILL to those left after ``grace_s``.
        False when the launch went through torchrun, which cannot signal one rank."""
        if self.fallback is not None:
            return False
        wanted = set(ranks)
        chosen = [rank for rank in self.ranks if rank.rank in wanted and not rank.poll()]
        for rank in chosen:
            rank.signal(signal.SIGTERM)
        if chosen:
            threading.Thread(target=self._kill_after, args=(chosen, grace_s), daemon=True,
                             name=f"relay-release-{self.place.assignment.launch_id}").start()
        return True

    @staticmethod
    def _kill_after(ranks: list[_WarmRank], grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for rank in ranks:
            if not rank.wait(max(0.0, deadline - time.monotonic())):
                rank.signal(signal.SIGKILL)

    def leftover_groups(self) -> list[int]:
        if self.fallback is not None:
            return self.fallback.leftover_groups()
        return [group for rank in self.ranks for group in rank.leftover_groups()]
