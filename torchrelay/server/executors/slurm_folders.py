"""The Slurm executor's side of the shared job folders: what it writes there, what it reads back.

Layout (``SlurmConfig.attempt_dir`` / ``code_dir``): ``<job_root>/<job>/code/`` (the bundle,
unpacked once), ``<job_root>/<job>/a<N>/launch.json`` (node 0's ``wire.LaunchAssignment``,
every node's launch id and the code folder: what ``torchrelay.agent.slurm_step`` reads),
``a<N>/node-<K>/records.jsonl`` and ``exit.json`` (what that launcher writes).

Contract:
- ``unpack_code(code_dir, bundle)``: the bundle's files in ``code_dir`` (an empty folder when
  there is none), unpacked beside it and renamed into place, so a folder that exists is
  whole. Idempotent. Raises ``OSError``, ``tarfile.TarError``, ``BundleRefused`` (a member
  that would land outside it).
- ``write_launch_plan(attempt_dir, assignment, launch_ids, code_dir)``: writes ``launch.json``.
- ``read_exit(path)``: the ``ExitRecord`` there, or None while there is none (or it is torn).
- ``RecordTail().read(path)``: the log and metric records appended since the last read (a
  line being written is left for the next read). Never raises on I/O.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

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


def write_launch_plan(attempt_dir: Path, assignment: LaunchAssignment, launch_ids: list[str], code_dir: Path) -> None:
    attempt_dir.mkdir(parents=True, exist_ok=True)
    (attempt_dir / "launch.json").write_text(json.dumps({
        "assignment": assignment.model_dump(mode="json"), "launch_ids": launch_ids, "code_dir": str(code_dir)}))


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
