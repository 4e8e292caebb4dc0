"""The Slurm executor's side of the shared job folders: what it writes there, what it reads back.

Layout (``SlurmConfig.attempt_dir`` / ``code_dir``): ``<job_root>/<job>/code/`` (the bundle,
unpacked once), ``<job_root>/<job>/a<N>/launch.json`` (node 0's ``wire.LaunchAssignment``,
every node's launch id and the code folder: what ``torchrelay.agent.slurm_step`` reads),
``a<N>/node-<K>/records.jsonl`` and ``exit.json`` (what that launcher writes). For requeues
(``slurm.json``, ``requeued.json``, ``requeued-<R>``) see below.

Contract:
- ``unpack_code(code_dir, bundle)``: the bundle's files in ``code_dir`` (an empty folder when
  there is none), unpacked beside it and renamed into place, so a folder that exists is
  whole. Idempotent. Raises ``OSError``, ``tarfile.TarError``, ``BundleRefused`` (a member
  that would land outside it).
- ``write_launch_plan(attempt_dir, assignment, launch_ids, code_dir, groups=None)``: writes
  ``launch.json`` (``groups``: ``{"nodes", "per_node", "env"}`` each, in rank order).
- ``SlurmRun(slurm_id, base, restart)``: which run of which Slurm job an attempt is (``base``:
  the folder of the attempt that submitted it, whose script it runs; ``restart``: Slurm's
  ``RestartCnt`` for that run). ``write_run`` / ``read_run``: ``a<N>/slurm.json`` (None: none
  written, an attempt submitted before there were any: its own, restart 0).
- ``write_requeued(attempt_dir, slurm_id, restart)`` / ``read_requeued``: ``a<N>/requeued.json``,
  written when Slurm's requeue ended attempt N: the next attempt adopts that Slurm job (also
  after a server restart in between) rather than submitting another.
- ``name_adopted(base, restart, attempt_dir)``: writes ``<base>/requeued-<restart>`` (atomically,
  after the attempt's ``launch.json``): the requeued run's batch script waits for it, then runs
  ``attempt_dir``.
- ``read_exit(path)``: the ``ExitRecord`` there, or None while there is none (or it is torn).
- ``RecordTail().read(path)``: the log and metric records appended since the last read (a
  line being written is left for the next read). Never raises on I/O.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from torchrelay.server.executors.slurm_batch import requeued_pointer
from torchrelay.server.executors.slurm_status import ExitRecord
from torchrelay.unpack import extract_bundle
from torchrelay.wire import LaunchAssignment, LaunchStatus, LogRecord, MetricRecord


def unpack_code(code_dir: Path, bundle: bytes | None) -> None:
    if code_dir.exists():
        return
    staging = code_dir.with_name(code_dir.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    if bundle is not None:
        # as the agent unpacks it (torchrelay.agent.bundles): nothing lands outside ``staging``
        extract_bundle(io.BytesIO(bundle), staging)
    staging.rename(code_dir)


def write_launch_plan(attempt_dir: Path, assignment: LaunchAssignment, launch_ids: list[str], code_dir: Path,
                      groups: list[dict] | None = None) -> None:
    attempt_dir.mkdir(parents=True, exist_ok=True)
    plan = {"assignment": assignment.model_dump(mode="json"), "launch_ids": launch_ids, "code_dir": str(code_dir)}
    if groups is not None:
        plan["groups"] = groups
    _write_atomic(attempt_dir / "launch.json", json.dumps(plan))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True, slots=True)
class SlurmRun:
    slurm_id: str
    base: str
    restart: int = 0


def write_run(attempt_dir: Path, run: SlurmRun) -> None:
    _write_atomic(attempt_dir / "slurm.json", json.dumps(asdict(run)))


def read_run(attempt_dir: Path) -> SlurmRun | None:
    data = _read_json(attempt_dir / "slurm.json")
    try:
        return SlurmRun(str(data["slurm_id"]), str(data["base"]), int(data["restart"])) if data else None
    except (KeyError, TypeError, ValueError):
        return None


def write_requeued(attempt_dir: Path, slurm_id: str, restart: int) -> None:
    _write_atomic(attempt_dir / "requeued.json", json.dumps({"slurm_id": slurm_id, "restart": restart}))


def read_requeued(attempt_dir: Path) -> tuple[str, int] | None:
    data = _read_json(attempt_dir / "requeued.json")
    try:
        return (str(data["slurm_id"]), int(data["restart"])) if data else None
    except (KeyError, TypeError, ValueError):
        return None


def name_adopted(base: str, restart: int, attempt_dir: Path) -> None:
    _write_atomic(Path(requeued_pointer(base, restart)), str(attempt_dir))


def read_exit(path: Path) -> ExitRecord | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return ExitRecord(status=LaunchStatus.model_validate(data["status"]), signalled=data.get("signalled"))


class RecordTail:
    """How far one launch's ``records.jsonl`` was read."""

    def __init__(self) -> None:
        self.offset = 0

    def read(self, path: Path) -> tuple[list[LogRecord], list[MetricRecord]]:
        try:
            with open(path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return [], []
        complete = data[:data.rfind(b"\n") + 1]
        self.offset += len(complete)
        logs: list[LogRecord] = []
        metrics: list[MetricRecord] = []
        for line in complete.splitlines():
            batch = json.loads(line)
            logs += [LogRecord.model_validate(r) for r in batch.get("logs", ())]
            metrics += [MetricRecord.model_validate(r) for r in batch.get("metrics", ())]
        return logs, metrics
