"""The node agent: register, long-poll the server, make its launches so, ship logs, clean up.

Contract:
- ``Agent(address, name=..., work_dir=...)`` does no I/O until ``run``.
- ``Agent.run(stop_event)`` blocks until ``stop_event`` is set, then calls ``close``. It
  registers (``POST /nodes/register``; retried until the server answers), then loops on the
  long-poll heartbeat (``POST /nodes/{id}/heartbeat``, ``wait_s`` s) reporting its launches,
  and reconciles each reply: a ``desired="run"`` launch it does not have is prepared (bundle
  fetched into ``work_dir/bundles`` keyed by digest, unpacked into the launch's directory)
  and started; node 0 picks the master port and posts it (``POST /launches/{id}/status``)
  before starting torchrun, other nodes wait for ``master_addr``/``master_port`` in a later
  reply; a launch with ``desired="stop"``, or one the server no longer lists, is stopped.
  Every state change is queued as a ``wire.LaunchStatus`` (in order, per launch) and goes with
  the next heartbeat (``Heartbeat.statuses``; the server applies them before it replies). After
  a reply that started a direct launch, that heartbeat waits (at most 0.25 s: a fork) until the
  launch left ``preparing``, so its ``running`` rides along. A change made while a long poll is
  in flight is posted at once by the shipper instead (``POST /launches/{id}/status``); one it
  could not deliver goes with the next heartbeat. Either way an ``exited`` goes only after the
  launch's lines and metrics were shipped. A ``preparing`` status a later one of the same
  launch supersedes is left out (``coalesce_statuses``). A server that answers
  ``statuses_taken=0`` (older than that field) gets every status posted. Node 0 of a world of
  one (``launcher.is_direct``) needs no port: nobody waits for it.
- Direct launches of Python workers are forked from the agent's zygote (``zygote.Zygote``,
  started with the first one; ``zygote=False`` or ``RELAY_AGENT_ZYGOTE=0`` turns it off).
- A background thread ships logs and metrics every ``ship_interval_s`` s
  (``POST /jobs/{job}/logs`` and ``/metrics``). While the server is unreachable everything is
  kept and resent later (the server dedups by sequence numbers); a server that forgot the
  node (404 on heartbeat) gets a re-registration with the old ``node_id``.
- ``Agent.close()`` stops every launch (SIGTERM, SIGKILL after ``stop_grace_s``), closes the
  zygote, tries once more to deliver what is pending, and returns when no process of any
  launch is left.
  Idempotent.

- On start, processes of launches in ``work_dir`` that an earlier agent left (it was killed
  without ``close``) are killed, and the agent registers under the node id saved there.

Layout of ``work_dir``: ``node.json`` (the node id), ``bundles/<sha256>.tar.gz``,
``zygote.log`` and ``launches/<launch_id>/`` (``code/`` plus the launcher's ``logs/``,
``metrics/``, ``status/``, ``torchrun.log`` or ``launch.log``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import httpx

from torchrelay import wire
from torchrelay.agent.gpus import GpuShortage, GpuSlots, visible_devices
from torchrelay.agent.launcher import Launch, find_launch_processes, is_direct, pick_free_port
from torchrelay.agent.zygote import Zygote

log = logging.getLogger(__name__)

MAX_RECORDS_PER_POST = 2000
MAX_BUFFERED_RECORDS = 200_000  # per launch; beyond this the oldest are dropped (and said so)


# ---------------------------------------------------------------- resources


def detect_cpus() -> float:
    """CPUs this process may run on (affinity mask), else ``os.cpu_count()``."""
    try:
        return float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return float(os.cpu_count() or 1)


def detect_memory() -> int:
    """Total memory in bytes from ``/proc/meminfo`` (0 if it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parse_nvidia_smi_list(text: str) -> tuple[int, str | None]:
    """``(count, type of the first)`` from ``nvidia-smi -L`` output (pure).

    A line looks like ``GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)``.
    """
    names = []
    for line in text.splitlines():
        if line.startswith("GPU ") and ":" in line:
            name = line.split(":", 1)[1].split("(UUID", 1)[0].strip()
            names.append(name)
    return len(names), (names[0] if names else None)


def detect_gpus() -> tuple[int, str | None]:
    """GPUs from ``nvidia-smi -L`` (no torch import: the daemon stays light); (0, None) if none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, None
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return 0, None
    if out.returncode != 0:
        return 0, None
    return parse_nvidia_smi_list(out.stdout)


def coalesce_statuses(outbox: list[tuple[str, wire.LaunchStatus]]) -> list[tuple[str, wire.LaunchStatus]]:
    """The entries of ``outbox`` worth sending, in order (pure; the same tuple objects).

    A ``preparing`` status followed by any later status of the same launch says nothing the
    later one does not (node 0's ``running`` repeats the port), so it is left out: a launch
    that started within one shipping cycle costs the server two posts (running, exited)
    instead of three or four. ``running`` and ``exited`` are always kept: the job's history
    shows both.
    """
    later: set[str] = set()
    kept = []
    for entry in reversed(outbox):
        launch_id, status = entry
        if status.state == "preparing" and launch_id in later:
            continue
        later.add(launch_id)
        kept.append(entry)
    kept.reverse()
    return kept


def settled_statuses(outbox: list[tuple[str, wire.LaunchStatus]],
                     sent: list[tuple[str, wire.LaunchStatus]]) -> list[tuple[str, wire.LaunchStatus]]:
    """The entries of ``outbox`` that need no sending any more, given that ``sent`` (entries
    of ``outbox``, by identity) reached the server: each launch's entries up to its last sent
    one (pure)."""
    sent_ids = {id(entry) for entry in sent}
    last_sent: dict[str, int] = {}
    for index, entry in enumerate(outbox):
        if id(entry) in sent_ids:
            last_sent[entry[0]] = index
    return [entry for index, entry in enumerate(outbox) if index <= last_sent.get(entry[0], -1)]


# ---------------------------------------------------------------- one launch on this node


class _Runner:
    """Drives one launch in its own thread: prepare, (publish port), start, watch, stop."""

    def __init__(self, agent: Agent, assignment: wire.LaunchAssignment):
        self.agent = agent
        self.assignment = assignment
        self.launch_id = assignment.launch_id
        self.state: str = "preparing"
        self.launch: Launch | None = None
        self.final: wire.LaunchStatus | None = None
        self.stop_requested = threading.Event()
        self.assignment_changed = threading.Condition()
        self.pending_logs: list[wire.LogRecord] = []
        self.pending_metrics: list[wire.MetricRecord] = []
        self.thread = threading.Thread(target=self._main, name=f"relay-launch-{self.launch_id}",
                                       daemon=True)

    @property
    def run_dir(self) -> Path:
        return self.agent.work_dir / "launches" / self.launch_id

    def update(self, assignment: wire.LaunchAssignment) -> None:
        with self.assignment_changed:
            self.assignment = assignment
            self.assignment_changed.notify_all()

    def request_stop(self) -> None:
        self.stop_requested.set()
        with self.assignment_changed:
            self.assignment_changed.notify_all()

    def _exit(self, status: wire.LaunchStatus) -> None:
        self.agent.gpu_slots.release(self.launch_id)
        self.final = status
        self.state = "exited"
        self.agent._post_status(self.launch_id, status)

    def _main(self) -> None:
        try:
            self._drive()
        except Exception as exc:  # noqa: BLE001 - a launch must end reported, whatever broke
            log.exception("launch %s failed in the agent", self.launch_id)
            if self.launch is not None:
                status = self.launch.stop(self.agent.stop_grace_s)
                status.message = f"agent error: {exc}; {status.message}"
            else:
                status = wire.LaunchStatus(state="exited", succeeded=False,
                                           stopped=self.stop_requested.is_set(),
                                           message=f"agent error: {type(exc).__name__}: {exc}")
            self._exit(status)

    def _drive(self) -> None:
        assignment = self.assignment
        self.agent._post_status(self.launch_id, wire.LaunchStatus(state="preparing"))
        try:
            code_dir = self._prepare_code_retrying(assignment)
        except (OSError, httpx.HTTPError, tarfile.TarError, ValueError) as exc:
            self._exit(wire.LaunchStatus(
                state="exited", succeeded=False, stopped=self.stop_requested.is_set(),
                message=f"cannot prepare bundle {assignment.bundle!r}: {exc}"))
            return
        if assignment.node_rank == 0:
            master_addr, master_port = self.agent.host, pick_free_port(self.agent.host)
            if not is_direct(assignment):  # peers wait for the port; a world of one has none
                self.agent._post_status(self.launch_id, wire.LaunchStatus(state="preparing",
                                                                          master_port=master_port))
        else:
            with self.assignment_changed:
                self.assignment_changed.wait_for(
                    lambda: self.stop_requested.is_set()
                    or (self.assignment.master_addr and self.assignment.master_port))
                master_addr, master_port = self.assignment.master_addr, self.assignment.master_port
        if self.stop_requested.is_set():
            self._exit(wire.LaunchStatus(state="exited", succeeded=False, stopped=True,
                                         message="stopped before it started"))
            return
        gpus_per_worker = int(self.assignment.env.get("RELAY_GPUS_PER_WORKER", "0") or 0)
        try:
            devices = self.agent.gpu_slots.take(self.launch_id, self.assignment.nproc_per_node * gpus_per_worker)
        except GpuShortage as exc:
            self._exit(wire.LaunchStatus(state="exited", succeeded=False, message=str(exc)))
            return
        launch = Launch(self.assignment, code_dir=code_dir, run_dir=self.run_dir,
                        relay_address=self.agent.address, zygote=self.agent.zygote,
                        cuda_visible_devices=visible_devices(devices, self.agent.gpus))
        self.launch = launch
        launch.start(master_addr, master_port)
        self.state = "running"
        self.agent._post_status(self.launch_id, wire.LaunchStatus(state="running",
                                                                  master_port=master_port
                                                                  if assignment.node_rank == 0 else None))
        while True:
            status = launch.wait(timeout=0.1)
            if status is not None:
                break
            if self.stop_requested.is_set():
                # the job's own grace (spec.stop_grace_s) lets workers commit a checkpoint on SIGTERM
                status = launch.stop(self.assignment.stop_grace_s)
                break
        self._exit(status)

    def _prepare_code_retrying(self, assignment: wire.LaunchAssignment) -> Path:
        """``Agent._prepare_code``, retried while the server cannot be reached (not on a
        refusal such as an unknown bundle), until the launch is stopped."""
        backoff = 0.2
        while True:
            try:
                return self.agent._prepare_code(assignment, self.run_dir)
            except httpx.TransportError as exc:
                if self.stop_requested.wait(backoff):
                    raise
                log.warning("launch %s: fetching bundle failed (%s); retrying", self.launch_id, exc)
                backoff = min(backoff * 2, 5.0)

    def take_records(self) -> None:
        """Move new log and metric records from the launch into this runner's buffers."""
        if self.launch is None:
            return
        self.pending_logs.extend(self.launch.take_logs())
        self.pending_metrics.extend(self.launch.take_metrics())
        for name in ("pending_logs", "pending_metrics"):
            buffered = getattr(self, name)
            if len(buffered) > MAX_BUFFERED_RECORDS:
                dropped = len(buffered) - MAX_BUFFERED_RECORDS
                log.warning("launch %s: server unreachable too long, dropping %d oldest %s",
                            self.launch_id, dropped, name.removeprefix("pending_"))
                del buffered[:dropped]


# ---------------------------------------------------------------- the agent


class Agent:
    """One node's agent. See the module docstring for the contract."""

    def __init__(self, address: str, *, name: str, host: str = "127.0.0.1",
                 cpus: float | None = None, gpus: int | None = None, memory: int | None = None,
                 work_dir: Path, labels: dict[str, str] | None = None,
                 heartbeat_wait_s: float = 10.0, ship_interval_s: float = 0.3,
                 stop_grace_s: float = 10.0, zygote: bool | None = None, gpu_type: str | None = None):
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
        self.gpu_slots = GpuSlots(self.gpus)  # which device indices each launch holds
        self.work_dir = Path(work_dir)
        self.labels = dict(labels or {})
        self.heartbeat_wait_s = heartbeat_wait_s
        self.ship_interval_s = ship_interval_s
        self.stop_grace_s = stop_grace_s
        self.node_id: str | None = None
        # Direct Python workers are forked from a warm interpreter (see zygote.py) unless
        # zygote=False or RELAY_AGENT_ZYGOTE=0; it starts with the first such launch.
        if zygote is None:
            zygote = os.environ.get("RELAY_AGENT_ZYGOTE", "1") != "0"
        self.zygote = Zygote(env={**os.environ, "PYTHONUNBUFFERED": "1"},
                             log_path=str(self.work_dir / "zygote.log")) if zygote else None
        self._version = -1
        self._wait_s = heartbeat_wait_s
        self._runners: dict[str, _Runner] = {}
        self._done: set[str] = set()  # launches this agent ran and let go of
        self._lock = threading.RLock()
        self._outbox: list[tuple[str, wire.LaunchStatus]] = []
        self._outbox_lock = threading.Lock()
        self._ship_lock = threading.Lock()  # one shipping cycle (or delivery check) at a time
        # Statuses ride in the next heartbeat; the shipper posts them itself only while a long
        # poll is in flight (``_polling``), so that they are not held until it returns, or when
        # the server does not take statuses in heartbeats (an older server answers 0 taken).
        self._beat_lock = threading.Lock()  # the heartbeat's outbox snapshot and ``_polling`` change together
        self._polling = False
        self._carrying: set[int] = set()  # ids of the outbox entries the heartbeat in flight carries
        self._posting: set[int] = set()  # ids of the outbox entries the shipper is posting right now
        # ids of outbox entries whose launch's earlier lines and metrics were shipped: only those
        # may end a launch from a heartbeat (an ``exited`` never arrives before its last lines)
        self._lines_shipped: set[int] = set()
        self._server_takes_statuses = True
        self._status_posted = threading.Event()
        self._ship_wake = threading.Event()
        self._bundle_lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        self._threads: list[threading.Thread] = []
        base = self.address + wire.API_PREFIX
        self._http = httpx.Client(base_url=base, timeout=10.0)
        self._poll_http = httpx.Client(base_url=base, timeout=heartbeat_wait_s + 15.0)

    # -------------------------------------------------------------- public

    def registration(self) -> wire.NodeRegistration:
        return wire.NodeRegistration(name=self.name, address=self.host, cpus=self.cpus,
                                     gpus=self.gpus, gpu_type=self.gpu_type, memory=self.memory,
                                     labels=self.labels, node_id=self.node_id)

    def run(self, stop_event: threading.Event) -> None:
        """Serve until ``stop_event`` is set, then ``close()``. Blocks."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._end_orphans()
        self.node_id = self.node_id or self._saved_node_id()
        for target, name in ((self._heartbeat_loop, "relay-agent-heartbeat"),
                             (self._ship_loop, "relay-agent-ship")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
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
        for runner in runners:
            runner.request_stop()
        for runner in runners:
            if runner.thread.is_alive():
                runner.thread.join()
            elif runner.launch is not None:  # never started thread or finished: sweep anyway
                runner.launch.stop(self.stop_grace_s)
        if self.zygote is not None:
            self.zygote.close()
        for thread in self._threads:
            if thread.name == "relay-agent-ship":
                thread.join(timeout=self.ship_interval_s + 12.0)
        try:
            self._ship_once()  # last chance for the final statuses and lines
        except Exception:  # noqa: BLE001 - closing must not fail because the server is gone
            log.debug("final shipping failed", exc_info=True)
        self._http.close()
        self._poll_http.close()

    def launches(self) -> dict[str, str]:
        """``{launch_id: state}`` of the launches this agent holds right now."""
        with self._lock:
            return {lid: runner.state for lid, runner in self._runners.items()}

    # -------------------------------------------------------------- heartbeat and reconcile

    def _end_orphans(self) -> None:
        """Kill processes of launches in ``work_dir`` left by an agent that died without
        ``close()`` (they carry that launch's ``RELAY_LAUNCH_ID`` and ``RELAY_LAUNCH_DIR``)."""
        launches = self.work_dir / "launches"
        for launch_dir in sorted(launches.iterdir()) if launches.is_dir() else ():
            pids = find_launch_processes(launch_dir.name, launch_dir)
            if pids:
                log.warning("ending %d processes of launch %s left by an earlier agent",
                            len(pids), launch_dir.name)
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass

    def _node_file(self) -> Path:
        return self.work_dir / "node.json"

    def _saved_node_id(self) -> str | None:
        """The node id an earlier agent in this ``work_dir`` registered under, if any: the
        server then learns at once that launches it thought running here are gone."""
        try:
            return json.loads(self._node_file().read_text()).get("node_id")
        except (OSError, ValueError, AttributeError):
            return None

    def _register(self) -> None:
        reply = self._http.post("/nodes/register", json=self.registration().model_dump(mode="json"))
        reply.raise_for_status()
        registered = wire.RegisterReply.model_validate(reply.json())
        if self.node_id is not None and registered.node_id != self.node_id:
            log.warning("server gave node id %s instead of %s", registered.node_id, self.node_id)
        self.node_id = registered.node_id
        self._version = -1
        # the server sees a node at the start of each beat: keep a long poll well inside its timeout
        self._wait_s = max(0.0, min(self.heartbeat_wait_s, registered.heartbeat_timeout_s / 3))
        try:
            self._node_file().write_text(json.dumps({"node_id": self.node_id, "server": self.address}))
        except OSError as exc:
            log.warning("cannot save node id in %s: %s", self._node_file(), exc)
        log.info("registered as node %s (%s) at %s", self.node_id, self.name, self.address)

    def _heartbeat_body(self) -> tuple[wire.Heartbeat, list, list]:
        """The next heartbeat, with the outbox as it was (``snapshot``) and the statuses it
        carries (``carried``, entries of the snapshot). Marks a long poll in flight (caller
        holds ``_beat_lock``)."""
        with self._lock:
            reports = [wire.LaunchReport(launch_id=lid, state=runner.state)
                       for lid, runner in self._runners.items()]
        snapshot: list = []
        carried: list = []
        if self._server_takes_statuses:
            with self._outbox_lock:
                snapshot = list(self._outbox)
            carried = coalesce_statuses([entry for entry in snapshot if id(entry) not in self._posting
                                         and (entry[1].state != "exited" or id(entry) in self._lines_shipped)])
        self._polling = self._wait_s > 0
        self._carrying = {id(entry) for entry in carried}
        return (wire.Heartbeat(launches=reports, wait_s=self._wait_s, known_version=self._version,
                               statuses=[wire.LaunchStatusReport(launch_id=lid, status=status)
                                         for lid, status in carried]),
                snapshot, carried)

    def _settle(self, snapshot: list, sent: list) -> None:
        """Drop from the outbox what ``sent`` (entries of ``snapshot``) delivered."""
        settled = {id(entry) for entry in settled_statuses(snapshot, sent)}
        if settled:
            with self._outbox_lock:
                self._outbox = [entry for entry in self._outbox if id(entry) not in settled]
            with self._beat_lock:  # (a settled entry's id may be reused by a new one)
                self._lines_shipped -= settled

    def _await_first_statuses(self, limit_s: float = 0.25) -> None:
        """Hold the next heartbeat while a direct launch this agent just started is still
        preparing (a fork from the zygote: milliseconds), up to ``limit_s``: its ``running``
        then rides in that heartbeat instead of costing a post of its own. Launches that wait
        for a peer's port are not waited for: they need the next reply."""
        deadline = time.monotonic() + limit_s
        while not self._closing.is_set():
            with self._lock:
                fresh = any(r.state == "preparing" and is_direct(r.assignment) for r in self._runners.values())
            left = deadline - time.monotonic()
            if not fresh or left <= 0:
                return
            self._status_posted.wait(left)
            self._status_posted.clear()

    def _heartbeat_loop(self) -> None:
        backoff = 0.2
        while not self._closing.is_set():
            started = time.monotonic()
            try:
                if self.node_id is None:
                    self._register()
                with self._beat_lock:
                    body, snapshot, carried = self._heartbeat_body()
                try:
                    reply = self._poll_http.post(f"/nodes/{self.node_id}/heartbeat", json=body.model_dump(mode="json"))
                finally:
                    with self._beat_lock:
                        self._polling = False
                        self._carrying = set()
                if reply.status_code == 404:
                    log.warning("server does not know node %s; registering again", self.node_id)
                    self._register()
                    continue
                reply.raise_for_status()
                beat = wire.HeartbeatReply.model_validate(reply.json())
                if carried:
                    if beat.statuses_taken == len(carried):
                        self._settle(snapshot, carried)
                    else:  # a server that does not read them: post them one by one from now on
                        log.warning("server took %d of %d statuses in a heartbeat; posting statuses instead",
                                    beat.statuses_taken, len(carried))
                        self._server_takes_statuses = False
                        self._ship_wake.set()
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any failed beat
                if self._closing.is_set():
                    return  # close() shut the client under an in-flight long poll
                log.warning("heartbeat to %s failed (%s); retrying in %.1fs", self.address, exc,
                            backoff)
                self._closing.wait(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.2
            if self._closing.is_set():
                return
            self._version = beat.version
            self.reconcile(beat.launches)
            self._await_first_statuses()
            # A server that keeps answering at once must not make this loop spin.
            self._closing.wait(max(0.0, 0.05 - (time.monotonic() - started)))

    def reconcile(self, assignments: list[wire.LaunchAssignment]) -> None:
        """Make this node's launches what ``assignments`` (a heartbeat reply) asks for."""
        wanted = {a.launch_id: a for a in assignments}
        with self._lock:
            if self._closing.is_set():
                return
            for launch_id, assignment in wanted.items():
                runner = self._runners.get(launch_id)
                if assignment.desired == "run":
                    if runner is not None:
                        runner.update(assignment)
                    elif launch_id not in self._done:
                        runner = _Runner(self, assignment)
                        self._runners[launch_id] = runner
                        runner.thread.start()
                elif runner is not None:
                    runner.update(assignment)  # carries the stop's grace (0 for cancel --no-checkpoint)
                    runner.request_stop()
                elif launch_id not in self._done:
                    # asked to stop something it never ran: say it is over so the server moves on
                    self._done.add(launch_id)
                    self._post_status(launch_id, wire.LaunchStatus(
                        state="exited", succeeded=False, stopped=True, message="never started"))
            finished = []
            for launch_id, runner in list(self._runners.items()):
                assignment = wanted.get(launch_id)
                if assignment is None or assignment.desired == "stop":
                    runner.request_stop()
                    if runner.state == "exited":
                        finished.append(runner)
        # Outside self._lock: _delivered takes _ship_lock, and the shipper holds _ship_lock
        # while it takes self._lock (the other order would deadlock the heartbeat loop).
        for runner in finished:
            if self._delivered(runner):
                with self._lock:
                    if self._runners.get(runner.launch_id) is runner:
                        del self._runners[runner.launch_id]
                        self._done.add(runner.launch_id)

    def _delivered(self, runner: _Runner) -> bool:
        """Whether everything the runner produced reached the server. Never waits: while the
        shipper is mid-cycle (an HTTP call that may be slow) the answer is "not yet", so the
        heartbeat loop that asks is never held up."""
        if not self._ship_lock.acquire(blocking=False):
            return False
        try:
            runner.take_records()
            with self._outbox_lock:
                queued = any(lid == runner.launch_id for lid, _ in self._outbox)
            return not queued and not runner.pending_logs and not runner.pending_metrics
        finally:
            self._ship_lock.release()

    # -------------------------------------------------------------- bundles

    def _bundle_path(self, digest: str) -> Path:
        return self.work_dir / "bundles" / f"{digest}.tar.gz"

    def _fetch_bundle(self, digest: str) -> Path:
        """The bundle's cached file, downloaded (and checked against ``digest``) if absent."""
        if not digest or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ValueError(f"bundle digest {digest!r} is not a sha256 hex string")
        path = self._bundle_path(digest)
        with self._bundle_lock:
            if path.exists():
                return path
            reply = self._http.get(f"/bundles/{digest}", timeout=300.0)
            reply.raise_for_status()
            data = reply.content
            actual = hashlib.sha256(data).hexdigest()
            if actual != digest.lower():
                raise ValueError(f"bundle {digest} arrived with sha256 {actual}; not using it")
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            return path

    def _prepare_code(self, assignment: wire.LaunchAssignment, run_dir: Path) -> Path:
        """The launch's code directory, unpacked from its bundle (empty without one)."""
        code_dir = run_dir / "code"
        marker = run_dir / ".unpacked"
        if marker.exists():
            return code_dir
        if code_dir.exists():
            shutil.rmtree(code_dir)  # a half-unpacked earlier try
        code_dir.mkdir(parents=True)
        if assignment.bundle:
            bundle = self._fetch_bundle(assignment.bundle)
            with tarfile.open(bundle, "r:gz") as tar:
                tar.extractall(code_dir, filter="data")
        marker.touch()
        return code_dir

    # -------------------------------------------------------------- shipping

    def _post_status(self, launch_id: str, status: wire.LaunchStatus) -> None:
        with self._outbox_lock:
            self._outbox.append((launch_id, status))
        self._status_posted.set()  # a heartbeat held for it goes now
        self._ship_wake.set()  # while a long poll is in flight the shipper posts it now, not next tick

    def _ship_loop(self) -> None:
        while True:
            self._ship_wake.wait(self.ship_interval_s)
            self._ship_wake.clear()
            if self._closing.is_set():
                break
            try:
                self._ship_once(statuses=None)
            except Exception:  # noqa: BLE001 - the shipper must outlive any one bad cycle
                log.exception("shipping logs failed")
        # closing: let the runners finish their stop, then flush what they produced
        while any(r.thread.is_alive() for r in list(self._runners.values())):
            try:
                self._ship_once()
            except Exception:  # noqa: BLE001
                log.debug("shipping while closing failed", exc_info=True)
            time.sleep(self.ship_interval_s)

    def _ship_once(self, statuses: bool | None = True) -> None:
        """One shipping cycle: logs and metrics first, then the statuses queued before them
        (``statuses=None``: only while no heartbeat is about to carry them, see ``_polling``)."""
        with self._ship_lock:
            self._ship_cycle(statuses)

    def _ship_cycle(self, post_statuses: bool | None = True) -> None:
        with self._outbox_lock:
            statuses = list(self._outbox)
        with self._lock:
            runners = list(self._runners.values())
        for runner in runners:
            runner.take_records()
            if not self._send_records(runner):
                return  # server unreachable: keep everything, keep the order
        with self._beat_lock:  # the heartbeat loop takes its snapshot under this lock
            # the lines and metrics taken above were produced before these statuses were queued
            self._lines_shipped.update(id(entry) for entry in statuses)
            if post_statuses is None:
                post_statuses = self._polling or not self._server_takes_statuses
            if not post_statuses:
                return  # the next heartbeat carries them (it goes as soon as the current reply is acted on)
            carrying = self._carrying
            sending = coalesce_statuses([entry for entry in statuses if id(entry) not in carrying])
            self._posting = {id(entry) for entry in sending}
        try:
            sent = self._post_statuses(sending)
        finally:
            with self._beat_lock:
                self._posting = set()
        self._settle(statuses, sent)

    def _post_statuses(self, sending: list) -> list:
        """Post statuses one by one, in order, until one cannot be delivered; returns those sent."""
        sent = []
        for entry in sending:
            launch_id, status = entry
            try:
                reply = self._http.post(f"/launches/{launch_id}/status",
                                        json=status.model_dump(mode="json"))
            except httpx.HTTPError as exc:
                log.warning("cannot post status of launch %s: %s", launch_id, exc)
                break
            if reply.status_code >= 500:
                log.warning("server refused status of launch %s: %s %s", launch_id,
                            reply.status_code, reply.text[:200])
                break
            if reply.status_code >= 400:  # it forgot the launch, or refuses it: don't resend
                log.warning("server rejected status %s of launch %s: %s %s", status.state,
                            launch_id, reply.status_code, reply.text[:200])
            sent.append(entry)
        return sent

    def _send_records(self, runner: _Runner) -> bool:
        """Post a runner's buffered logs and metrics; False if the server could not be reached."""
        job = runner.assignment.job_id
        for kind, batch_type in (("logs", wire.LogBatch), ("metrics", wire.MetricBatch)):
            buffered = runner.pending_logs if kind == "logs" else runner.pending_metrics
            while buffered:
                chunk = buffered[:MAX_RECORDS_PER_POST]
                body = batch_type(launch_id=runner.launch_id, records=chunk)
                try:
                    reply = self._http.post(f"/jobs/{job}/{kind}", json=body.model_dump(mode="json"))
                except httpx.HTTPError as exc:
                    log.warning("cannot ship %s of launch %s: %s", kind, runner.launch_id, exc)
                    return False
                if reply.status_code >= 500:
                    return False
                if reply.status_code >= 400:
                    log.warning("server rejected %s of launch %s: %s %s", kind, runner.launch_id,
                                reply.status_code, reply.text[:200])
                del buffered[:len(chunk)]
        return True
