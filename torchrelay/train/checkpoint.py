"""Checkpoints in the artifact store: atomic, verified, with fallback to the previous good one.

Layout under ``ArtifactStore.checkpoint_prefix(job)``::

    step-0000000100/state.pt        torch.save of the state dict
    step-0000000100/MANIFEST.json   {"format", "step", "created", "files": {name: {sha256, size}}}
    latest                          text: the directory name of the newest committed checkpoint

Contract:
- A checkpoint is *committed* when its ``MANIFEST.json`` exists: every file is written first
  (each under a temporary name, then renamed), the manifest last, then ``latest``. A crash at
  any point leaves the previous committed checkpoint loadable; ``latest`` only ever names a
  committed one. Saving a step that already exists first removes its manifest (uncommits it).
- After a save at step s, checkpoints newer than s (an abandoned earlier attempt) and all but
  the newest ``keep`` committed ones are deleted, as are uncommitted folders older than s.
- Loading tries committed checkpoints newest first, checks the size and sha256 of every file
  the manifest lists and unpickles with ``torch.load(weights_only=True)``; a checkpoint that
  fails any of these is skipped with a warning naming it and the reason, and the previous one
  is tried. A malicious pickle is refused by ``weights_only`` and never runs.
- ``save_checkpoint`` is called on every rank: it first runs the prepared optimizer's
  ``before_checkpoint()`` if it has one (``train.sync``'s final averaging, a collective), then
  writes on the main rank only (replicas hold the same state) and returns the checkpoint's URL
  on every rank without waiting for the write. ``load_checkpoint`` reads on every rank.
  (Issue 3 moves the bytes onto torch.distributed.checkpoint behind these same signatures.)
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import posixpath
import re
import time
from typing import Any, Callable

import torch

from torchrelay.errors import CheckpointCorrupt, NotFound, StorageError
from torchrelay.storage import ArtifactStore, validate_relative_path

log = logging.getLogger("torchrelay.train.checkpoint")

MANIFEST = "MANIFEST.json"
LATEST = "latest"
STATE_FILE = "state.pt"
FORMAT = "torchrelay-checkpoint/1"
_STEP_DIR_RE = re.compile(r"^step-(\d{10,})$")


# ---------------------------------------------------------------- pure parts


def step_dirname(step: int) -> str:
    """Folder name of the checkpoint at ``step`` (sorts by step as text). Raises ``ValueError`` for step < 0."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step={step!r} must be an int >= 0")
    return f"step-{step:010d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a checkpoint folder name, or None for anything else."""
    match = _STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def build_manifest(step: int, files: dict[str, bytes], created: float) -> bytes:
    """Manifest bytes naming each file's sha256 and size."""
    entries = {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
               for name, data in sorted(files.items())}
    return json.dumps({"format": FORMAT, "step": step, "created": created, "files": entries},
                      indent=1, sort_keys=True).encode()


def verify(name: str, manifest_bytes: bytes, read: Callable[[str], bytes]) -> dict[str, bytes]:
    """Every file of checkpoint ``name`` after checking it against the manifest.

    ``read(file_name)`` returns a file's bytes or raises ``NotFound``. Raises
    ``CheckpointCorrupt`` with the reason (bad manifest, missing file, size or sha256 mismatch).
    """
    try:
        manifest = json.loads(manifest_bytes)
        files = manifest["files"]
        step = manifest["step"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            raise ValueError("unknown format or no files")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{MANIFEST} is not a valid manifest ({exc})") from None
    if parse_step_dirname(name) != step:
        raise CheckpointCorrupt(f"{MANIFEST} says step {step!r} but the folder is {name!r}")
    out: dict[str, bytes] = {}
    for file_name, entry in sorted(files.items()):
        try:
            validate_relative_path(file_name)
            expected_sha, expected_size = str(entry["sha256"]), int(entry["size"])
        except (StorageError, KeyError, TypeError, ValueError):
            raise CheckpointCorrupt(f"{MANIFEST} entry {file_name!r} is malformed") from None
        try:
            data = read(file_name)
        except NotFound:
            raise CheckpointCorrupt(f"file {file_name!r} listed in {MANIFEST} is missing") from None
        if len(data) != expected_size:
            raise CheckpointCorrupt(f"file {file_name!r} has {len(data)} bytes, {MANIFEST} says "
                                    f"{expected_size} (truncated or overwritten)")
        actual_sha = hashlib.sha256(data).hexdigest()
        if actual_sha != expected_sha:
            raise CheckpointCorrupt(f"file {file_name!r} has sha256 {actual_sha[:12]}…, {MANIFEST} says "
                                    f"{expected_sha[:12]}… (corrupted)")
        out[file_name] = data
    return out


def decode_state(data: bytes) -> Any:
    """Unpickle checkpoint bytes with ``weights_only=True`` onto the CPU. Raises ``CheckpointCorrupt``."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError… for bad input
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointCorrupt(f"{STATE_FILE} cannot be loaded with weights_only=True "
                                f"({type(exc).__name__}: {first_line[:200]})") from None


def decode_files(files: dict[str, bytes]) -> Any:
    """The state held by a verified checkpoint's files. Raises ``CheckpointCorrupt``."""
    if STATE_FILE not in files:
        raise CheckpointCorrupt(f"{MANIFEST} lists no {STATE_FILE}")
    return decode_state(files[STATE_FILE])


# ---------------------------------------------------------------- store-backed


@dataclasses.dataclass
class Loaded:
    """A checkpoint that verified, and those newer that did not (``(name, reason)``)."""

    step: int
    name: str
    files: dict[str, bytes]
    state: Any = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)


class CheckpointStore:
    """The checkpoints of one job in an ``ArtifactStore``. Not safe for two writers at once."""

    def __init__(self, store: ArtifactStore, job_id: str, keep: int = 3,
                 clock: Callable[[], float] = time.time):
        if keep < 1:
            raise ValueError(f"keep={keep!r} must be >= 1")
        self.store = store
        self.prefix = ArtifactStore.checkpoint_prefix(job_id)
        self.keep = keep
        self.clock = clock

    def key(self, *parts: str) -> str:
        return posixpath.join(self.prefix, *parts)

    def url(self, name: str) -> str:
        return self.store.url_of(self.key(name))

    def folders(self) -> dict[int, bool]:
        """{step: committed} for every checkpoint folder present."""
        found: dict[int, bool] = {}
        for rel, _size in self.store.list(self.prefix):
            head, _, tail = rel.partition("/")
            step = parse_step_dirname(head)
            if step is not None:
                found[step] = found.get(step, False) or tail == MANIFEST
        return found

    def latest_name(self) -> str | None:
        """What ``latest`` names, or None."""
        try:
            return self.store.get_bytes(self.key(LATEST)).decode().strip() or None
        except NotFound:
            return None

    def save(self, files: dict[str, bytes], step: int) -> str:
        """Write and commit ``files`` as the checkpoint at ``step``; returns its URL. Raises ``StorageError``."""
        name = step_dirname(step)
        if not files:
            raise ValueError("a checkpoint needs at least one file")
        manifest_key = self.key(name, MANIFEST)
        if self.store.exists(manifest_key):
            self.store.delete_prefix(manifest_key)
        for file_name, data in files.items():
            self.store.put_bytes(self.key(name, validate_relative_path(file_name)), data)
        self.store.put_bytes(manifest_key, build_manifest(step, files, self.clock()))
        self.store.put_bytes(self.key(LATEST), name.encode())
        self._prune(step)
        return self.url(name)

    def _prune(self, saved_step: int) -> None:
        folders = self.folders()
        committed = sorted(s for s, ok in folders.items() if ok and s <= saved_step)
        kept = set(committed[-self.keep:])
        for step, ok in folders.items():
            stale = step > saved_step or (step < saved_step and (not ok or step not in kept))
            if stale:
                self.store.delete_prefix(self.key(step_dirname(step)))

    def load(self, decode: Callable[[dict[str, bytes]], Any] | None = None) -> Loaded | None:
        """The newest checkpoint that verifies (and decodes, when ``decode`` is given), or None.

        Skipped ones are logged as warnings and listed in ``Loaded.skipped``.
        """
        skipped: list[tuple[str, str]] = []
        for step in sorted(self.folders(), reverse=True):
            name = step_dirname(step)
            try:
                try:
                    manifest = self.store.get_bytes(self.key(name, MANIFEST))
                except NotFound:
                    raise CheckpointCorrupt(f"no {MANIFEST} (never committed: the save did not finish)") from None
                files = verify(name, manifest, lambda f, n=name: self.store.get_bytes(self.key(n, f)))
                state = decode(files) if decode is not None else None
            except CheckpointCorrupt as exc:
                skipped.append((name, str(exc)))
                log.warning("checkpoint %s skipped: %s", self.url(name), exc)
                continue
            if skipped:
                log.warning("checkpoint %s loaded instead of %s", self.url(name), ", ".join(n for n, _ in skipped))
            return Loaded(step=step, name=name, files=files, state=state, skipped=skipped)
        return None


# ---------------------------------------------------------------- the job's checkpoints


def job_checkpoints() -> CheckpointStore:
    """This job's ``CheckpointStore`` (keep from ``RELAY_CHECKPOINT``)."""
    from torchrelay.train.artifacts import job_store
    from torchrelay.train.context import current_context

    store, job_id = job_store()
    return CheckpointStore(store, job_id, keep=current_context().checkpoint.keep)


def save_checkpoint(state: dict, step: int) -> str:
    """Commit ``state`` (tensors, state dicts, numbers, strings) as the checkpoint at ``step``.

    Call it on every rank: the prepared optimizer's ``before_checkpoint()`` runs first where it
    has one (final averaging makes it a collective), and ``state``'s tensors should be the live
    ones (``state_dict()`` shares storage) so they hold its result. Then the main rank writes;
    every rank gets the checkpoint URL without waiting for the write. Raises ``StorageError`` (unwritable store, full disk) on the main rank, leaving the
    previous checkpoint loadable.
    """
    from torchrelay.train.artifacts import serialize
    from torchrelay.train.context import current_context, current_optimizer

    before = getattr(current_optimizer(), "before_checkpoint", None)
    if callable(before):
        before()  # e.g. final averaging: the checkpoint holds the consensus (collective)
    checkpoints = job_checkpoints()
    name = step_dirname(step)
    if not current_context().is_main:
        return checkpoints.url(name)
    return checkpoints.save({STATE_FILE: serialize(state)}, step)


def load_checkpoint() -> tuple[Any, int] | None:
    """(state, step) of the newest checkpoint that verifies, or None when there is none.

    Tensors land on the CPU (``load_state_dict`` moves them). Corrupt ones are skipped with a
    warning naming each and why.
    """
    loaded = job_checkpoints().load(decode=decode_files)
    return None if loaded is None else (loaded.state, loaded.step)


def checkpoint_due(step: int) -> bool:
    """True when the job's policy (``checkpoint.every_steps``) asks for a checkpoint at ``step``."""
    from torchrelay.train.context import current_context

    every = current_context().checkpoint.every_steps
    return every > 0 and step > 0 and step % every == 0
