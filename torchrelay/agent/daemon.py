"""The node agent: register, long-poll the server, make its launches so, deliver what it owes, clean up.

Contract:
- ``Agent(address, name=..., work_dir=...)`` does no I/O until ``run``. Three seams, which tests
  fill with fakes: ``launch_factory`` (how a launch is made; by default ``launcher.Launch`` with
  the agent's zygote), ``server`` (a ``server_link.ServerLink``; by default HTTP to ``address``)
  and ``sweep`` (what kills the processes an earlier agent's launch left; returns how many).
- ``Agent.run(stop_event)`` blocks until ``stop_event`` is set, then calls ``close``. First it
  refuses (``ValueError`` naming the address and this host's interfaces) a ``host`` that no
  interface here holds, works out what its launches get for their transports
  (``netif.transport_env``: the interface of ``host``, or the ``socket_ifname`` label) and opens
  the reach probe on ``host`` (``reach.ReachProbe``; its port and token go in the registration,
  and the server connects to it before it places work here); then the processes of launches in
  ``work_dir`` that an earlier agent left (it was killed without ``close``) are killed; then two
  threads run:
  * the **poller** registers (under the node id saved in ``work_dir``, if any, so that the
    server learns at once that the launches it thought running here are gone; retried until
    the server answers, and again when the server no longer knows the node), then long-polls
    the heartbeat (``wait_s`` s) with the launches it holds and the statuses ready in the
    outbox, and reconciles each reply (``reconcile.plan_reconcile``): a new launch gets a
    ``runner.LaunchRunner`` (its own thread: bundle, port, start, watch, stop); a launch wanted
    to stop, or no longer listed, is stopped. After a reply that started a direct launch, the
    next heartbeat waits (at most 0.25 s: a fork) until that launch left ``preparing``, so that
    its ``running`` rides along.
  * the **courier** delivers the outbox (``outbox.Outbox``) every ``ship_interval_s`` s, or at
    once when something was queued: log and metric batches first (``POST /jobs/{job}/logs``,
    ``/metrics``; while the server cannot be reached everything is kept, in order, and sent
    again later: the server drops what it has seen by sequence number), then, while a long
    poll is in flight, the statuses ready in a heartbeat of its own (``wait_s=0``), so that no
    status waits for the poll to return.
  Statuses have one path, the heartbeat (``Heartbeat.statuses``, applied by the server before
  it replies); an ``exited`` goes only after the launch's lines and metrics were delivered, and
  a launch is let go of only once nothing of it is owed.
- Direct launches of Python workers are forked from the agent's zygote (``zygote.Zygote``,
  started with the first one; ``zygote=False`` or ``RELAY_AGENT_ZYGOTE=0`` turns it off), the
  ranks of every other launch from its warm zygote (torch imported; ``warm.WarmBackend``, also
  started with the first one and turned off by the same switch: torchrun then).
- Limits (``cgroups="auto"|"on"|"off"``, default ``RELAY_AGENT_CGROUPS`` else auto): the agent
  enforces its offer (``cpus``, ``memory``) and each launch's grant with cgroups
  (``torchrelay.agent.cgroups``), created in ``run`` under ``cgroup_parent`` (default: its own
  cgroup). "auto" uses them when this process can (root, the controllers mounted) and says once
  why not otherwise (also when the hierarchy refuses, e.g. a v2 parent that cannot delegate);
  "on" makes ``run`` raise ``cgroups.CgroupUnavailable`` or ``cgroups.CgroupError`` instead.
- ``Agent.close()`` stops every launch (SIGTERM, SIGKILL after the grace), closes the zygote,
  delivers what it can, and returns when no process of any launch is left. Idempotent.

Locks: ``_lock`` guards the agent's state (its runners, the launches it let go of, closing),
and ``_changed`` (on it) signals a runner's state change; the outbox has its own lock, and each
runner a condition of its own for assignment updates. Taken in that order only; the outbox
calls nothing while it holds its lock.

Layout of ``work_dir``: ``node.json`` (the node id), ``bundles/<sha256>.tar.gz``,
``zygote.log`` and ``launches/<launch_id>/`` (``code/`` plus the launcher's ``logs/``,
``metrics/``, ``status/``, ``torchrun.log`` or ``launch.log``).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchrelay import wire
from torchrelay.agent.bundles import BundleCache
from torchrelay.agent.cgroups import AgentCgroups, CgroupError, CgroupUnavailable
from torchrelay.agent.gpus import GpuSlots
from torchrelay.agent.launcher import Launch, has_launcher_process
from torchrelay.agent.netif import check_advertised, transport_env
from torchrelay.agent.outbox import Carrier, Entry, EntryKind, Outbox
from torchrelay.agent.processes import kill_launch_processes
from torchrelay.agent.reach import ReachProbe
from torchrelay.agent.reconcile import LaunchState, plan_reconcile
from torchrelay.agent.resources import detect_cpus, detect_gpus, detect_launcher_labels, detect_memory
from torchrelay.agent.runner import LaunchFactory, LaunchHandle, LaunchRunner, RunnerDeps
from torchrelay.agent.server_link import HttpServerLink, NodeUnknown, ServerLink, ServerRefused, ServerUnreachable
from torchrelay.agent.zygote import Zygote

# What the warm zygote imports before it forks ranks: torch, and the platform's training library
# (its import, torch.distributed.checkpoint with it, costs seconds of CPU per rank otherwise).
# Neither reads the environment nor starts a thread when imported.
WARM_PRELOAD = ("torch", "torchrelay.train", "torchrelay.train.elastic", "torchrelay.train.elastic_sync")

log = logging.getLogger(__name__)

MAX_RECORDS_PER_POST = 2000
FIRST_STATUS_WAIT_S = 0.25  # how long a heartbeat waits for a direct launch's ``running``
MIN_BEAT_SPACING_S = 0.05  # a server that keeps answering at once must not make the poller spin


class Agent:
    """One node's agent. See the module docstring for the contract."""

    def __init__(self, address: str, *, name: str, host: str = "127.0.0.1",
                 cpus: float | None = None, gpus: int | None = None, memory: int | None = None,
                 work_dir: Path, labels: dict[str, str] | None = None,
                 heartbeat_wait_s: float = 10.0, ship_interval_s: float = 0.3,
                 stop_grace_s: float = 10.0, zygote: bool | None = None, gpu_type: str | None = None,
                 launch_factory: LaunchFactory | None = None, server: ServerLink | None = None,
                 sweep: Callable[[str, Path], int] = kill_launch_processes,
                 cgroups: str | None = None, cgroup_parent: str | None = None, enroll_token: str | None = None):
        if not address.startswith(("http://", "https://")):
            raise ValueError(f"address {address!r} is not a URL; give e.g. http://127.0.0.1:8765")
        if not name:
            raise ValueError(f"name {name!r} is empty; give the node a name")
        self.address = address.rstrip("/")
        self.name = name
        self.host = host
        detected_gpus, detected_type = detect_gpus() if gpus is None else (gpus, None)
        # an explicit gpu_type names the kind when detection cannot (no nvidia-smi) or to group nodes
        self.gpu_type = gpu_type or detected_type
        self.cpus = detect_cpus() if cpus is None else float(cpus)
        self.gpus = detected_gpus
        if gpu_type and not self.gpus:
            raise ValueError(f"gpu_type {gpu_type!r} was given but this node offers 0 gpus; "
                             "give --gpus N (N > 0) with --gpu-type, or drop --gpu-type")
        self.memory = detect_memory() if memory is None else int(memory)
        self.cgroups_mode = cgroups or os.environ.get("RELAY_AGENT_CGROUPS", "auto")
        if self.cgroups_mode not in ("auto", "on", "off"):
            raise ValueError(f"cgroups {self.cgroups_mode!r} is not one of auto, on, off")
        self.cgroup_parent = cgroup_parent
        self.cgroups: AgentCgroups | None = None  # created in run()
        self.work_dir = Path(work_dir)
        self.labels = {**detect_launcher_labels(), **(labels or {})}  # --label relay.mpirun=no turns MPI off
        self.heartbeat_wait_s = heartbeat_wait_s
        self.ship_interval_s = ship_interval_s
        self.stop_grace_s = stop_grace_s
        self.node_id: str | None = None
        if zygote is None:
            zygote = os.environ.get("RELAY_AGENT_ZYGOTE", "1") != "0"
        self.zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             log_path=str(self.work_dir / "zygote.log")) if zygote else None
        # the warm zygote (torch and torchrelay.train imported) forks the ranks of multi-rank
        # launches; started with the first one. Its environment is what a launch's would be
        # (OMP_NUM_THREADS=1 unless set).
        self.warm_zygote = Zygote(env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1"},
                                  log_path=str(self.work_dir / "warm-zygote.log"),
                                  preload=WARM_PRELOAD) if zygote else None
        self.server: ServerLink = server or HttpServerLink(
            self.address, long_poll_s=heartbeat_wait_s, enroll_token=enroll_token,
            credential_file=self.work_dir / "node.credential")
        self.outbox = Outbox()
        self.gpu_slots = GpuSlots(self.gpus)  # which device indices each launch holds
        self._sweep = sweep
        bundles = BundleCache(self.work_dir / "bundles", self.server.fetch_bundle)
        self._deps = RunnerDeps(
            host=host, work_dir=self.work_dir, prepare_code=lambda a, run_dir: bundles.unpack(a.bundle, run_dir),
            new_launch=launch_factory or self._new_launch, gpu_slots=self.gpu_slots, node_gpus=self.gpus,
            outbox=self.outbox, report=self._report, records_queued=self._wake_courier,
            ship_interval_s=ship_interval_s, stop_grace_s=stop_grace_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._runners: dict[str, LaunchRunner] = {}
        self._done: set[str] = set()  # launches this agent ran (or was told to stop) and let go of
        self._closing = threading.Event()
        self._closed = False
        self._needs_registering = True
        self._version = -1
        self._wait_s = heartbeat_wait_s
        self._courier_wake = threading.Event()
        self._courier_done = threading.Event()
        self._courier: threading.Thread | None = None
        self.node_env: dict[str, str] = {}  # what every launch gets for its transports (set by ``run``)
        self.probe: ReachProbe | None = None

    # -------------------------------------------------------------- public

    def registration(self) -> wire.NodeRegistration:
        return wire.NodeRegistration(name=self.name, address=self.host, cpus=self.cpus,
                                     gpus=self.gpus, gpu_type=self.gpu_type, memory=self.memory,
                                     labels=self.labels, node_id=self.node_id,
                                     probe_port=self.probe.port if self.probe else None,
                                     probe_token=self.probe.token if self.probe else None)

    def run(self, stop_event: threading.Event) -> None:
        """Serve until ``stop_event`` is set, then ``close()``. Blocks. Raises ``ValueError`` when
        no interface of this host holds ``host``."""
        interface = check_advertised(self.host)
        self.node_env = transport_env(self.host, labels=self.labels, agent_env=dict(os.environ))
        log.info("advertising %s (interface %s); launches get %s", self.host, interface, self.node_env)
        self.probe = ReachProbe(self.host)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._end_orphans()
        self._open_cgroups()
        self.node_id = self.node_id or self._saved_node_id()
        threading.Thread(target=self._poll_loop, name="relay-agent-poller", daemon=True).start()
        self._courier = threading.Thread(target=self._courier_loop, name="relay-agent-courier", daemon=True)
        self._courier.start()
        try:
            stop_event.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Stop every launch and wait until none of their processes is left. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            runners = list(self._runners.values())
            self._changed.notify_all()
        for runner in runners:
            runner.request_stop()
        for runner in runners:
            if runner.thread.is_alive():
                runner.thread.join()
            elif runner.launch is not None:  # finished: sweep what it may have left anyway
                runner.launch.stop(self.stop_grace_s)
        for zygote in (self.zygote, self.warm_zygote):
            if zygote is not None:
                zygote.close()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.probe is not None:
            self.probe.close()
        self._courier_done.set()
        self._wake_courier()
        if self._courier is not None:
            self._courier.join(timeout=self.ship_interval_s + 12.0)
        try:
            self._deliver(Carrier.FINAL)  # last chance for the final lines and statuses
        except Exception:  # noqa: BLE001 - closing must not fail because the server is gone
            log.debug("final delivery failed", exc_info=True)
        self.server.close()

    def launches(self) -> dict[str, str]:
        """``{launch_id: state}`` of the launches this agent holds right now."""
        with self._lock:
            return {lid: runner.state.value for lid, runner in self._runners.items()}

    def reconcile(self, assignments: list[wire.LaunchAssignment]) -> None:
        """Make this node's launches what ``assignments`` (a heartbeat reply) asks for."""
        with self._lock:
            if self._closing.is_set():
                return
            held = {lid: runner.state for lid, runner in self._runners.items()}
            owed = {lid for lid, state in held.items() if state is LaunchState.EXITED and self.outbox.owes(lid)}
            plan = plan_reconcile(held=held, done=self._done, wanted=assignments, owed=owed)
            for assignment in plan.start:
                runner = self._runners[assignment.launch_id] = LaunchRunner(assignment, self._deps)
                runner.start()
            for assignment in plan.update:
                self._runners[assignment.launch_id].update(assignment)
            for launch_id in plan.stop:
                self._runners[launch_id].request_stop()
            for launch_id in plan.forget:
                del self._runners[launch_id]
                self._done.add(launch_id)
            for launch_id in plan.never_ran:  # say it is over, so that the server moves on
                self._done.add(launch_id)
                self.outbox.put_status(launch_id, wire.LaunchStatus(
                    state="exited", succeeded=False, stopped=True, message="never started"))
        if plan.never_ran:
            self._wake_courier()

    # -------------------------------------------------------------- what runners report

    def _new_launch(self, assignment: wire.LaunchAssignment, *, code_dir: Path, run_dir: Path,
                    cuda_visible_devices: str | None) -> LaunchHandle:
        cgroup = None if self.cgroups is None else self.cgroups.launch(
            assignment.launch_id, cpu_per_worker=assignment.cpu, memory_per_worker=assignment.memory,
            workers=assignment.nproc_per_node,
            launcher_process=has_launcher_process(assignment, self.zygote, self.warm_zygote))
        return Launch(assignment, code_dir=code_dir, run_dir=run_dir, relay_address=self.address,
                      zygote=self.zygote, cuda_visible_devices=cuda_visible_devices, cgroup=cgroup,
                      node_env=self.node_env, warm_zygote=self.warm_zygote)

    def _open_cgroups(self) -> None:
        """This agent's cgroup, with its offer as the ceiling (see the module docstring)."""
        if self.cgroups_mode == "off" or self.cgroups is not None:
            return
        try:
            self.cgroups = AgentCgroups.open(cpus=self.cpus, memory=self.memory, parent=self.cgroup_parent)
        except (CgroupUnavailable, CgroupError) as exc:  # e.g. a v2 parent that cannot delegate
            if self.cgroups_mode == "on":
                raise
            log.warning("running without cgroup limits: %s", exc)
            return
        log.info("enforcing %g cpus and %d bytes with cgroups in %s", self.cpus, self.memory,
                 ", ".join(self.cgroups.dirs))

    def _report(self, runner: LaunchRunner, status: wire.LaunchStatus) -> None:
        """A runner's state change: held as its state, queued for the server."""
        with self._lock:
            runner.state = LaunchState(status.state)
            self.outbox.put_status(runner.launch_id, status)
            self._changed.notify_all()  # a heartbeat held for it goes now
        self._wake_courier()

    def _wake_courier(self) -> None:
        self._courier_wake.set()

    # -------------------------------------------------------------- registration and orphans

    def _end_orphans(self) -> None:
        """Kill processes of launches in ``work_dir`` left by an agent that died without
        ``close()`` (they carry that launch's ``RELAY_LAUNCH_ID`` and ``RELAY_LAUNCH_DIR``)."""
        launches = self.work_dir / "launches"
        for launch_dir in sorted(launches.iterdir()) if launches.is_dir() else ():
            ended = self._sweep(launch_dir.name, launch_dir)
            if ended:
                log.warning("ended %d processes of launch %s left by an earlier agent", ended, launch_dir.name)

    def _node_file(self) -> Path:
        return self.work_dir / "node.json"

    def _saved_node_id(self) -> str | None:
        """The node id an earlier agent in this ``work_dir`` registered under, if any."""
        try:
            return json.loads(self._node_file().read_text()).get("node_id")
        except (OSError, ValueError, AttributeError):
            return None

    def _register(self) -> None:
        registered = self.server.register(self.registration())
        if self.node_id is not None and registered.node_id != self.node_id:
            log.warning("server gave node id %s instead of %s", registered.node_id, self.node_id)
        self.node_id = registered.node_id
        self._needs_registering = False
        self._version = -1
        # the server sees a node at the start of each beat: keep a long poll well inside its timeout
        self._wait_s = max(0.0, min(self.heartbeat_wait_s, registered.heartbeat_timeout_s / 3))
        try:
            self._node_file().write_text(json.dumps({"node_id": self.node_id, "server": self.address}))
        except OSError as exc:
            log.warning("cannot save node id in %s: %s", self._node_file(), exc)
        log.info("registered as node %s (%s) at %s", self.node_id, self.name, self.address)

    # -------------------------------------------------------------- the poller

    def _poll_loop(self) -> None:
        backoff = 0.2
        while not self._closing.is_set():
            started = time.monotonic()
            try:
                if self._needs_registering:
                    self._register()
                reply = self._heartbeat(Carrier.LONG_POLL if self._wait_s > 0 else Carrier.HEARTBEAT)
            except NodeUnknown:
                log.warning("server does not know node %s; registering again", self.node_id)
                self._needs_registering = True
                continue
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any failed beat
                if self._closing.is_set():
                    return  # close() shut the connection under an in-flight long poll
                log.warning("heartbeat to %s failed (%s); retrying in %.1fs", self.address, exc, backoff)
                self._closing.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            if self._closing.is_set():
                return
            self._version = reply.version
            self.reconcile(reply.launches)
            self._await_first_statuses()
            self._closing.wait(max(0.0, MIN_BEAT_SPACING_S - (time.monotonic() - started)))

    def _heartbeat(self, carrier: Carrier) -> wire.HeartbeatReply | None:
        """One heartbeat carrying the statuses ready for ``carrier`` (a long poll for
        ``LONG_POLL``); the reply, or None when an ``ASIDE``/``FINAL`` beat had nothing to carry.
        Raises what ``ServerLink.heartbeat`` raises; what it did not deliver waits again."""
        with self._lock:  # the launches with their statuses: a status never names an unreported launch
            reports = [wire.LaunchReport(launch_id=lid, state=runner.state.value)
                       for lid, runner in self._runners.items()]
            statuses = self.outbox.take_statuses(carrier)
        if not statuses and carrier in (Carrier.ASIDE, Carrier.FINAL):
            return None
        beat = wire.Heartbeat(launches=reports, known_version=self._version,
                              wait_s=self._wait_s if carrier is Carrier.LONG_POLL else 0.0,
                              statuses=[wire.LaunchStatusReport(launch_id=e.launch_id, status=e.status)
                                        for e in statuses])
        taken = 0
        try:
            reply = self.server.heartbeat(self.node_id, beat)
            taken = reply.statuses_taken
            return reply
        finally:
            if carrier is Carrier.LONG_POLL:
                self.outbox.end_long_poll()
            self.outbox.settle(statuses[:taken], delivered=True)
            self.outbox.settle(statuses[taken:], delivered=False)

    def _await_first_statuses(self) -> None:
        """Hold the next heartbeat while a direct launch this agent just started is still
        preparing (a fork from the zygote: milliseconds), up to ``FIRST_STATUS_WAIT_S``: its
        ``running`` then rides in that heartbeat. Launches that wait for a peer's port are not
        waited for: they need the next reply."""
        with self._lock:
            self._changed.wait_for(lambda: self._closing.is_set() or not any(
                r.state is LaunchState.PREPARING and r.direct for r in self._runners.values()),
                timeout=FIRST_STATUS_WAIT_S)

    # -------------------------------------------------------------- the courier

    def _courier_loop(self) -> None:
        while not self._courier_done.is_set():
            self._courier_wake.wait(self.ship_interval_s)
            self._courier_wake.clear()
            try:
                # closing: the poller is gone, so the courier carries the statuses itself
                self._deliver(Carrier.FINAL if self._closing.is_set() else Carrier.ASIDE)
            except Exception:  # noqa: BLE001 - the courier must outlive any one bad cycle
                log.exception("delivering to %s failed", self.address)

    def _deliver(self, carrier: Carrier) -> None:
        """The outbox's batches, then its ready statuses (for ``carrier``) in a heartbeat."""
        if not self._deliver_batches():
            return  # server unreachable: the statuses wait behind the lines (keep the order)
        if self.node_id is not None:
            try:
                self._heartbeat(carrier)
            except (ServerUnreachable, ServerRefused) as exc:
                log.warning("cannot deliver statuses to %s: %s", self.address, exc)

    def _post_halving(self, kind: EntryKind, job_id: str, launch_id: str, records: list) -> None:
        """``post_records``; a batch over the server's size limit (413) is posted again in halves,
        so that a server with a small ``limits.log_batch`` loses no line. Raises what it raises."""
        try:
            self.server.post_records(kind, job_id, launch_id, records)
        except ServerRefused as exc:
            if exc.status_code != 413 or len(records) < 2:
                raise
            half = len(records) // 2
            self._post_halving(kind, job_id, launch_id, records[:half])
            self._post_halving(kind, job_id, launch_id, records[half:])

    def _deliver_batches(self) -> bool:
        """Post the waiting log and metric batches, one launch and kind after the other, in
        order; False (all that is left kept) when the server could not be reached."""
        taken = self.outbox.take_records()
        groups: dict[tuple, list[Entry]] = {}
        for entry in taken:
            groups.setdefault((entry.launch_id, entry.kind), []).append(entry)
        for index, ((launch_id, kind), entries) in enumerate(groups.items()):
            records = [record for entry in entries for record in entry.records]
            for start in range(0, len(records), MAX_RECORDS_PER_POST):
                try:
                    self._post_halving(kind, entries[0].job_id, launch_id,
                                       records[start:start + MAX_RECORDS_PER_POST])
                except (ServerUnreachable, ServerRefused) as exc:
                    if isinstance(exc, ServerRefused) and exc.status_code < 500:
                        # it forgot the job, or refuses it: sending it again will not help
                        log.warning("server rejected %s of launch %s: %s", kind.value, launch_id, exc)
                        continue
                    log.warning("cannot ship %s of launch %s: %s", kind.value, launch_id, exc)
                    self.outbox.settle([e for group in list(groups.values())[index:] for e in group], delivered=False)
                    return False
            self.outbox.settle(entries, delivered=True)
        return True
