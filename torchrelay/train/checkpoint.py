"""Checkpoints in the artifact store: torch.distributed.checkpoint, committed by a manifest, verified, async.

Layout under ``ArtifactStore.checkpoint_prefix(job)``::

    step-0000000100/__0_0.distcp …   tensor bytes written by rank 0 (see checkpoint_dcp)
    step-0000000100/__1_0.distcp …   rank 1's share: DCP spreads replicated tensors over ranks
    step-0000000100/.metadata         DCP's metadata (where each value lies)
    step-0000000100/MANIFEST.json    {"format", "step", "created", "files": {name: {sha256, size}}}
    latest                           text: the folder name of the newest committed checkpoint

Contract:
- A checkpoint is *committed* when its ``MANIFEST.json`` exists. Rank 0 clears the step's
  folder before any rank writes (saving a step again uncommits it first); every rank writes and
  fsyncs its files; rank 0 then writes ``.metadata``, the manifest (sha256 and size of every file
  of every rank), then ``latest``. A crash or a write error at any point leaves the previous
  committed checkpoint loadable, and ``latest`` only ever names a committed one.
- After a commit at step s, checkpoints newer than s (an abandoned earlier attempt) and all but
  the newest ``keep`` committed ones are deleted, as are uncommitted folders older than s.
- Loading tries checkpoint folders newest first. Every file the manifest lists is hashed
  (each rank hashes a share and the ranks agree on the verdict, so all load the same step);
  a checkpoint with a missing, truncated or changed file, no manifest, or a value that would
  run code when unpickled is skipped with a warning naming it and why, and the previous one is
  tried. Nothing in a checkpoint can run code (checkpoint_dcp: raw tensor bytes,
  ``weights_only=True``, allowlisted metadata). A read error (store unreachable) is raised as
  ``StorageError``, never taken for damage: a job must not silently start over.
- ``save_checkpoint`` is called on every rank (DCP's save is a collective on a gloo group of
  its own, so an async save never interleaves with training's collectives). What the prepared
  optimizer names as differing between ranks (local SGD, DiLoCo, final averaging) is written
  once per rank and loaded back by its own rank; a checkpoint holding such replicas refuses a
  job with another world size (``InvalidSpec``). See checkpoint_replicas. Under the
  ``parameter_server`` strategy server ranks never join, so worker rank 0 writes alone.
- Fencing: a store made with ``attempt=N`` reads ``ArtifactStore.attempt_key(job)`` (the
  server advances it to the job's current attempt, by compare-and-swap where the store has one,
  when it places one) before it clears a step's folder and again just before it commits; when
  that names a newer attempt it raises ``StaleAttempt`` and changes nothing, so the workers of a
  replaced attempt (orphans on a node that lost contact) cannot overwrite, commit or prune the
  new attempt's checkpoints. The manifest is written with ``put_if_absent`` (``If-None-Match: *``
  on S3, ``link(2)`` on a folder), so a commit never replaces another writer's manifest. The
  fence check and the manifest write are still two store operations: docs/checkpoints.md says
  what that leaves, store by store.
- The server hears of each commit: ``job_checkpoints()`` passes ``checkpoint_notice.notify_commit``
  as ``on_commit``, which rank 0 calls with the step and URL once ``latest`` names the new
  checkpoint; it becomes a job event (``relay status``) and a ``checkpoint`` event of the
  server's events feed (docs/queues.md). It never fails the save.
- Async (``async_=True`` or the policy's ``async``): the call returns once a background thread
  has started copying the state; writing and committing happen behind training. At most one
  save is in flight: the next save (or ``wait_for_checkpoint()``) waits for it and raises its
  error. The state's tensors must not change until the copy is done: the prepared optimizer's
  ``step()`` and the objects passed as ``guard`` (``TrainState`` passes its model and
  optimizer; a module's forward waits only if it has buffers) wait for it by themselves.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import posixpath
import re
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from torchrelay.errors import CheckpointCorrupt, InvalidPath, NotFound, StaleAttempt, StorageError
from torchrelay.spec import CheckpointPolicy
from torchrelay.storage import ArtifactStore, describe_os_error, validate_relative_path
from torchrelay.train.artifacts import job_store
from torchrelay.train.checkpoint_dcp import DEFAULT_THREADS, LoadTarget, SafeLoadPlanner, StoreReader, StoreWriter
from torchrelay.train.checkpoint_notice import notify_commit
from torchrelay.train.checkpoint_replicas import (REPLICAS, belongs_to_other_rank, join_replicas, same_memory,
                                                  split_replicas)
from torchrelay.train.preempt import mark_cooperative, poll_stop_for_checkpoint
from torchrelay.train.prepared import StrategyOptimizer, strategy_optimizer
from torchrelay.train.roles import Roles
from torchrelay.train.session import current_session

log = logging.getLogger("torchrelay.train.checkpoint")
# DCP warns on every single-process save/load even when asked for one (no_dist=True)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized, assuming")

MANIFEST = "MANIFEST.json"
LATEST = "latest"
FORMAT = "torchrelay-checkpoint/2"
INT_KEYS = "_torchrelay_int_keys"  # paths of dicts whose keys were ints (DCP makes every key a str)
EMPTY_DICTS = "_torchrelay_empty_dicts"  # paths of empty dicts (DCP's flattening drops them)
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


def build_manifest(step: int, entries: dict[str, dict[str, Any]], created: float) -> bytes:
    """Manifest bytes: ``entries`` maps each file name to ``{"sha256", "size"}``."""
    files = {name: {"sha256": str(e["sha256"]), "size": int(e["size"])} for name, e in sorted(entries.items())}
    return json.dumps({"format": FORMAT, "step": step, "created": created, "files": files},
                      indent=1, sort_keys=True).encode()


def parse_manifest(name: str, manifest_bytes: bytes) -> dict[str, tuple[str, int]]:
    """``{file: (sha256, size)}`` of checkpoint folder ``name``'s manifest. Raises ``CheckpointCorrupt``."""
    try:
        manifest = json.loads(manifest_bytes)
        files, step = manifest["files"], manifest["step"]
        if manifest.get("format") != FORMAT or not isinstance(files, dict) or not files:
            raise ValueError(f"format {manifest.get('format')!r} (expected {FORMAT!r}) or no files")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointCorrupt(f"{MANIFEST} is not a valid manifest ({exc})") from None
    if parse_step_dirname(name) != step:
        raise CheckpointCorrupt(f"{MANIFEST} says step {step!r} but the folder is {name!r}")
    out: dict[str, tuple[str, int]] = {}
    for file_name, entry in files.items():
        try:
            if validate_relative_path(file_name) != file_name or "/" in file_name:
                raise ValueError
            out[file_name] = (str(entry["sha256"]), int(entry["size"]))
        except (StorageError, InvalidPath, KeyError, TypeError, ValueError):
            raise CheckpointCorrupt(f"{MANIFEST} entry {file_name!r} is malformed") from None
    return out


def check_file(file_name: str, expected: tuple[str, int], actual: tuple[str, int] | None) -> str | None:
    """Why a file does not match its manifest entry, or None when it does. Pure."""
    if actual is None:
        return f"file {file_name!r} listed in {MANIFEST} is missing"
    (want_sha, want_size), (sha, size) = expected, actual
    if size != want_size:
        return f"file {file_name!r} has {size} bytes, {MANIFEST} says {want_size} (truncated or overwritten)"
    if sha != want_sha:
        return f"file {file_name!r} has sha256 {sha[:12]}…, {MANIFEST} says {want_sha[:12]}… (corrupted)"
    return None


def encode_int_keys(state: Any, path: tuple = ()) -> tuple[Any, list[tuple]]:
    """``state`` with int dict keys made str (as DCP stores them) and the paths of those dicts.

    Optimizer state dicts key their per-parameter state by int; without this they would come
    back keyed by '0', '1' … and ``Optimizer.load_state_dict`` would silently drop them.
    Raises ``ValueError`` naming the path of a key that is neither str nor int. Pure.
    """
    if isinstance(state, dict):
        paths: list[tuple] = []
        out = {}
        has_int = False
        for key, value in state.items():
            if isinstance(key, int) and not isinstance(key, bool):
                has_int, key = True, str(key)
            elif not isinstance(key, str):
                raise ValueError(f"checkpoint key {key!r} at {'.'.join(map(str, path)) or '<top>'} must be a str "
                                 "or an int")
            out[key], inner = encode_int_keys(value, path + (key,))
            paths.extend(inner)
        if len(out) != len(state):
            raise ValueError(f"checkpoint keys at {'.'.join(map(str, path)) or '<top>'} collide once made str")
        return out, ([path] if has_int else []) + paths
    if isinstance(state, list):
        paths = []
        items = []
        for index, value in enumerate(state):
            item, inner = encode_int_keys(value, path + (index,))
            items.append(item)
            paths.extend(inner)
        return items, paths
    return state, []


def empty_dict_paths(state: Any, path: tuple = ()) -> list[tuple]:
    """Paths of the empty dicts in ``state`` (nested dicts and lists). Pure."""
    if isinstance(state, dict):
        if not state and path:
            return [path]
        return [p for key, value in state.items() for p in empty_dict_paths(value, path + (key,))]
    if isinstance(state, list):
        return [p for index, value in enumerate(state) for p in empty_dict_paths(value, path + (index,))]
    return []


def restore_empty_dicts(state: dict, paths: Iterable[Iterable]) -> None:
    """Put back, in place, the empty dicts ``empty_dict_paths`` found where a loaded state lacks them."""
    for path in (tuple(p) for p in paths):
        node: Any = state
        for part in path[:-1]:
            if isinstance(node, dict):
                node = node.setdefault(part, {})
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                break
        else:
            if isinstance(node, dict):
                node.setdefault(path[-1], {})


def decode_int_keys(state: Any, paths: Iterable[Iterable]) -> Any:
    """Undo ``encode_int_keys`` in place on a loaded state; returns it."""
    for path in sorted((tuple(p) for p in paths), key=len, reverse=True):
        parent, node = None, state
        try:
            for part in path:
                parent, node = node, node[part]
        except (KeyError, IndexError, TypeError):
            continue  # a value the loader did not ask for
        converted = {(int(k) if isinstance(k, str) and k.lstrip("-").isdigit() else k): v for k, v in node.items()}
        if parent is None:
            state = converted
        else:
            parent[path[-1]] = converted
    return state


# ---------------------------------------------------------------- store-backed


@dataclasses.dataclass
class Loaded:
    """A checkpoint that verified, and those newer that did not (``(name, reason)``)."""

    step: int
    name: str
    state: Any = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _rank_world(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _failure_message(exc: CheckpointException) -> tuple[str, bool]:
    """(message naming the failing ranks, whether a failure was a storage error other than damage)."""
    parts, io_error = [], False
    for rank, (error, _trace) in sorted(exc.failures.items()):
        io_error = io_error or (isinstance(error, StorageError) and not isinstance(error, CheckpointCorrupt))
        parts.append(f"rank {rank}: {error}" if len(exc.failures) > 1 else str(error))
    return "; ".join(parts) or str(exc), io_error


class CheckpointStore:
    """The checkpoints of one job in an ``ArtifactStore``. One writer (job) at a time."""

    def __init__(self, store: ArtifactStore, job_id: str, keep: int = 3,
                 clock: Callable[[], float] = time.time, threads: int = DEFAULT_THREADS,
                 attempt: int | None = None, on_commit: Callable[[int, str], None] | None = None):
        if keep < 1:
            raise ValueError(f"keep={keep!r} must be >= 1")
        self.store = store
        self.job_id = job_id
        self.attempt = attempt
        self.prefix = ArtifactStore.checkpoint_prefix(job_id)
        self.keep = keep
        self.clock = clock
        self.threads = threads
        self.on_commit = on_commit  # (step, url) once a checkpoint is committed (checkpoint_notice)

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

    # ------------------------------------------------------------ save

    def writer(self, step: int) -> StoreWriter:
        """The DCP writer of the checkpoint at ``step``: clears its folder first, commits it last."""
        name = step_dirname(step)

        def start() -> None:
            self.check_fence(step)
            self.store.delete_prefix(self.key(name))  # uncommit and drop what an older attempt left

        def commit(entries: dict[str, dict[str, Any]]) -> None:
            self.check_fence(step)
            # never over another writer's manifest: start() removed ours, so one here is theirs
            if not self.store.put_if_absent(self.key(name, MANIFEST), build_manifest(step, entries, self.clock())):
                raise StaleAttempt(f"checkpoint of step {step} of {self.job_id} was not committed: another "
                                   f"writer committed {self.url(name)} first")
            self.store.put_bytes(self.key(LATEST), name.encode())
            if self.on_commit is not None:
                self.on_commit(step, self.url(name))
            self._prune(step)

        return StoreWriter(self.store, self.key(name), threads=self.threads, on_start=start, on_commit=commit)

    def save(self, state: dict, step: int, *, group: Any = None,
             split: Callable[[dict], dict] | None = None) -> str:
        """Write and commit ``state`` as the checkpoint at ``step``; returns its URL. Blocks.

        Collective over ``group`` (None: this process alone). ``split`` (see ``_prepare_state``)
        moves the values that differ between ranks into this rank's own entry. Raises
        ``StorageError`` on every rank when any rank failed to write, leaving the previous
        checkpoint loadable.
        """
        encoded = _prepare_state(state, split)
        try:
            dcp.save(encoded, storage_writer=self.writer(step), planner=DefaultSavePlanner(),
                     process_group=group, no_dist=group is None)
        except CheckpointException as exc:
            raise self._save_failed(step, exc) from None
        return self.url(step_dirname(step))

    def check_fence(self, step: int) -> None:
        """Raise ``StaleAttempt`` if the server has placed a newer attempt than this store's.

        No-op without an attempt or a fence. A fence that cannot be read raises ``StorageError``."""
        if self.attempt is None:
            return
        try:
            current = self.store.get_bytes(ArtifactStore.attempt_key(self.job_id)).decode().strip()
        except NotFound:
            return
        if current.isdigit() and int(current) > self.attempt:
            raise StaleAttempt(f"checkpoint of step {step} of {self.job_id} was not written: this worker belongs "
                               f"to attempt {self.attempt}, and the server has placed attempt {current} since "
                               "(this node lost contact and its workers were replaced)")

    def _save_failed(self, step: int, exc: CheckpointException) -> StorageError | StaleAttempt:
        stale = [error for error, _trace in exc.failures.values() if isinstance(error, StaleAttempt)]
        if stale:  # leave the new attempt's files alone
            return stale[0]
        message, _ = _failure_message(exc)
        name = step_dirname(step)
        try:  # free the space a failed save took (a full disk is the usual cause)
            if not self.store.exists(self.key(name, MANIFEST)):
                self.store.delete_prefix(self.key(name))
        except (OSError, StorageError):
            pass
        return StorageError(f"checkpoint of step {step} at {self.url(name)} was not saved: {message}")

    def _prune(self, saved_step: int) -> None:
        folders = self.folders()
        committed = sorted(s for s, ok in folders.items() if ok and s <= saved_step)
        kept = set(committed[-self.keep:])
        for step, ok in folders.items():
            stale = step > saved_step or (step < saved_step and (not ok or step not in kept))
            if stale:
                self.store.delete_prefix(self.key(step_dirname(step)))

    # ------------------------------------------------------------ verify and load

    def _digest(self, name: str, file_name: str) -> tuple[str, int] | None:
        hasher, size = hashlib.sha256(), 0
        buffer = bytearray(8 << 20)
        view = memoryview(buffer)
        try:
            with self.store.fs.open(self.store.full_path(self.key(name, file_name)), "rb") as fh:
                while True:
                    got = fh.readinto(view)
                    if not got:
                        break
                    hasher.update(view[:got])
                    size += got
        except FileNotFoundError:
            return None
        except self.store.failures as exc:
            raise StorageError(f"cannot read {self.url(name)}/{file_name}: {describe_os_error(exc)}") from exc
        return hasher.hexdigest(), size

    def verify(self, name: str, group: Any = None) -> str | None:
        """Why checkpoint ``name`` cannot be trusted, or None. Collective over ``group``: each
        rank hashes a share of the files and every rank returns the same verdict."""
        reason: str | None = None
        try:
            expected = parse_manifest(name, self.store.get_bytes(self.key(name, MANIFEST)))
        except NotFound:
            reason, expected = f"no {MANIFEST} (never committed: the save did not finish)", {}
        except CheckpointCorrupt as exc:
            reason, expected = str(exc), {}
        rank, world = _rank_world(group)
        for file_name in sorted(expected)[rank::world]:
            reason = reason or check_file(file_name, expected[file_name], self._digest(name, file_name))
        if world > 1:
            verdicts: list[Any] = [None] * world
            dist.all_gather_object(verdicts, reason, group=group)
            reason = next((v for v in verdicts if v), None)
        return reason

    def load(self, decode: Callable[..., Any] | None = None, group: Any = None) -> Loaded | None:
        """The newest checkpoint that verifies (and decodes, when ``decode`` is given), or None.

        ``decode(checkpoints, name, group)`` returns the state (``decode_files`` reads it all).
        Collective over ``group``. Skipped ones are logged as warnings and listed in
        ``Loaded.skipped``.
        """
        skipped: list[tuple[str, str]] = []
        for step in sorted(self.folders(), reverse=True):
            name = step_dirname(step)
            reason = self.verify(name, group)
            state = None
            if reason is None and decode is not None:
                try:
                    state = decode(self, name, group)
                except CheckpointCorrupt as exc:
                    reason = str(exc)
            if reason is not None:
                skipped.append((name, reason))
                log.warning("checkpoint %s skipped: %s", self.url(name), reason)
                continue
            if skipped:
                log.warning("checkpoint %s loaded instead of %s", self.url(name), ", ".join(n for n, _ in skipped))
            return Loaded(step=step, name=name, state=state, skipped=skipped)
        return None


def _prepare_state(state: dict, split: Callable[[dict], dict] | None = None) -> dict:
    """What DCP saves for ``state``: ``split`` applied (checkpoint_replicas), then int keys encoded."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    for reserved in (INT_KEYS, EMPTY_DICTS, REPLICAS):
        if reserved in state:
            raise ValueError(f"checkpoint key {reserved!r} is reserved by torchrelay")
    if split is not None:
        state = split(state)
    encoded, paths = encode_int_keys(state)
    if paths:
        encoded[INT_KEYS] = [list(p) for p in paths]
    empty = empty_dict_paths(encoded)
    if empty:  # e.g. the "state" of an optimizer without momentum: load_state_dict needs the key
        encoded[EMPTY_DICTS] = [list(p) for p in empty]
    return encoded


def decode_files(checkpoints: CheckpointStore, name: str, group: Any = None, *, rank: int | None = None,
                 world_size: int | None = None, target: LoadTarget | None = None) -> dict:
    """The state of verified checkpoint ``name`` as rank ``rank`` of ``world_size`` saved it (default:
    this process's place in ``group``), tensors on the CPU. Other ranks' replica entries are not
    read. ``target`` (a sharded load, checkpoint_dcp) puts the tensors it names into this rank's
    shards instead. Raises ``CheckpointCorrupt``, and ``InvalidSpec`` when the checkpoint holds the
    diverged replicas of another number of ranks (checkpoint_replicas)."""
    group_rank, group_world = _rank_world(group)
    rank = group_rank if rank is None else rank
    world_size = group_world if world_size is None else world_size
    planner = SafeLoadPlanner(skip=lambda path: belongs_to_other_rank(path, rank), target=target)
    reader = StoreReader(checkpoints.store, checkpoints.key(name))
    reader.read_metadata()  # CheckpointCorrupt here, before DCP wraps it (every rank reads the same bytes)
    try:
        dcp.load({}, storage_reader=reader, planner=planner, process_group=group, no_dist=group is None)
    except CheckpointException as exc:
        message, io_error = _failure_message(exc)
        # a read error (store unreachable) must not make the job start over: only damage skips
        raise (StorageError if io_error else CheckpointCorrupt)(message) from None
    state = planner.original_state_dict  # the template-free planner builds the state itself
    paths = state.pop(INT_KEYS, None) or []
    restore_empty_dicts(state, state.pop(EMPTY_DICTS, None) or [])
    return join_replicas(decode_int_keys(state, paths), rank, world_size, where=f"checkpoint {checkpoints.url(name)}")


# ---------------------------------------------------------------- the job's checkpoints
# What follows works on the session's checkpoint state (train.session): its own process group,
# the async save in flight and the threads that stage and upload it.


def job_checkpoints() -> CheckpointStore:
    """This job's ``CheckpointStore`` (keep from ``RELAY_CHECKPOINT``)."""
    store, job_id = job_store()
    ctx = current_session().known_context()
    return CheckpointStore(store, job_id, keep=ctx.checkpoint.keep, attempt=ctx.attempt, on_commit=notify_commit)


def _save_group() -> tuple[bool, Any]:
    """(this rank writes, process group or None). Collective the first time (makes the group)."""
    session = current_session()
    ctx = session.known_context()
    if not Roles.of(ctx.rank, ctx.world_size, ctx.strategy).collectives_on_default_group:
        return ctx.is_main, None  # server ranks never join a collective: worker 0 writes alone
    if not (dist.is_available() and dist.is_initialized()):
        return ctx.is_main, None  # ranks without a process group cannot agree: the main one writes
    if dist.get_world_size() == 1:
        return True, None
    state = session.checkpoint
    with state.lock:
        world = dist.group.WORLD
        if state.group is None or state.group[0] is not world:  # none yet, or made before a re-init
            # async saves run their collectives from a background thread: they need a group of
            # their own (gloo, which also serves nccl jobs' CPU copies), or they would interleave
            # with training's collectives on the default group
            state.group = (world, dist.new_group(backend="gloo"))
        return True, state.group[1]


@dataclasses.dataclass
class PendingSave:
    """An async save: its staging copy (``staged``) and its upload and commit (``done``)."""

    step: int
    url: str
    staged: Future
    done: Future
    checkpoints: CheckpointStore
    hooks: list[Any] = dataclasses.field(default_factory=list)


def save_in_progress() -> bool:
    """True while an async save is still being written (neither committed nor failed). Does not block."""
    pending = current_session().checkpoint.in_flight
    return pending is not None and not pending.done.done()


def wait_for_staging() -> None:
    """Block until the in-flight async save holds its own copy of the state (no-op without one)."""
    pending = current_session().checkpoint.in_flight
    if pending is not None:
        try:
            pending.staged.result()
        except Exception:  # noqa: BLE001 - the upload fails with it and wait_for_checkpoint raises it
            pass
        _remove_hooks(pending)


def _remove_hooks(pending: PendingSave) -> None:
    hooks, pending.hooks = pending.hooks, []
    for handle in hooks:
        handle.remove()


def wait_for_checkpoint() -> str | None:
    """Block until the in-flight async save is committed; its URL, or None when none was in flight.

    Raises ``StorageError`` (on every rank) when that save failed; the previous checkpoint stays
    loadable. Call it before the process ends (``shutdown()`` does).
    """
    state = current_session().checkpoint
    pending, state.in_flight = state.in_flight, None
    if pending is None:
        return None
    try:
        pending.done.result()
    except CheckpointException as exc:
        raise pending.checkpoints._save_failed(pending.step, exc) from None
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(f"checkpoint of step {pending.step} at {pending.url} was not saved: {exc}") from exc
    finally:
        _remove_hooks(pending)
    return pending.url


def _guard(pending: PendingSave, guarded: Iterable[Any]) -> None:
    """Make ``guarded`` optimizers' step() and modules' forward() (those with buffers) wait for the staging copy.

    A strategy's optimizer that wraps another (``train.sync``'s) is guarded through the one it
    wraps too (``StrategyOptimizer.inner``), whose ``step()`` is what changes the parameters.
    """
    def wait(*_args: Any, **_kwargs: Any) -> None:
        wait_for_staging()  # by its module name: a bench times what the hooks wait

    seen: set[int] = set()
    for obj in guarded:
        targets = [obj, strategy_optimizer(obj).inner] if isinstance(obj, torch.optim.Optimizer) else [obj]
        for target in targets:
            if target is None or id(target) in seen:
                continue
            seen.add(id(target))
            try:
                if isinstance(target, torch.optim.Optimizer):
                    pending.hooks.append(target.register_step_pre_hook(wait))
                elif isinstance(target, torch.nn.Module) and next(target.buffers(), None) is not None:
                    # forward changes buffers (batch-norm statistics); parameters change only in step()
                    pending.hooks.append(target.register_forward_pre_hook(wait))
            except (TypeError, AttributeError):
                pass  # an optimizer without torch's hook table (a wrapper): its inner one is guarded


def save_checkpoint(state: dict, step: int, async_: bool | None = None, guard: Iterable[Any] = ()) -> str:
    """Commit ``state`` (tensors, state dicts, numbers, strings) as the checkpoint at ``step``; its URL.

    Call it on every rank, with the live tensors (``state_dict()`` shares storage). The prepared
    optimizer's ``before_checkpoint()`` runs first (final averaging: a collective). Replicated
    tensors are written once, spread over the ranks; keys that only one rank has (per-rank RNG
    states) are written by that rank. Tensors that the prepared optimizer names as differing
    between ranks (``per_replica_tensors()``; under local SGD, DiLoCo and final averaging: inner
    optimizer state, buffers, and parameters between sync points) are written once per rank and
    each rank loads its own back (checkpoint_replicas); they are recognised by their memory, so
    pass live tensors (``state_dict()``), not copies.

    ``async_`` (default: the job policy's ``async``) returns as soon as a background copy of the
    state has started; the prepared optimizer and the objects in ``guard`` (optimizers, modules)
    wait for that copy before they change the tensors. At most one save is in flight: this call
    first waits for the previous one. Raises ``StorageError`` (full disk, unwritable store) on
    every rank, for this save or a failed previous async one; the previous checkpoint stays
    loadable.
    """
    session = current_session()
    wait_for_staging()  # before_checkpoint may change the parameters: the previous save holds its copy first
    session.hooks.before_checkpoint()  # e.g. final averaging: the checkpoint holds the consensus (collective)
    ctx = session.known_context()
    async_ = ctx.checkpoint.async_ if async_ is None else bool(async_)
    checkpoints = job_checkpoints()
    url = checkpoints.url(step_dirname(step))
    wait_for_checkpoint()
    writes, group = _save_group()
    if not writes:
        return url
    split = _replica_split(session.hooks, group)
    if not async_:
        return checkpoints.save(state, step, group=group, split=split)
    stager, uploader = _async_workers()
    staged = stager.stage(_prepare_state(state, split))  # a Future: the copy runs in the stager's thread
    writer = checkpoints.writer(step)

    def upload() -> None:
        dcp.save(staged.result(), storage_writer=writer, planner=DefaultSavePlanner(), process_group=group,
                 no_dist=group is None)

    pending = PendingSave(step=step, url=url, staged=staged, done=uploader.submit(upload), checkpoints=checkpoints)
    pending.done.add_done_callback(lambda f, p=pending: _report_failure(p, f))
    _guard(pending, [session.optimizer, *guard])
    session.checkpoint.in_flight = pending
    return url


def _replica_split(optimizer: StrategyOptimizer, group: Any) -> Callable[[dict], dict] | None:
    """How this rank's state is split (checkpoint_replicas), or None when every rank holds the same.

    The prepared optimizer names the tensors that differ between ranks now
    (``per_replica_tensors()``: local SGD, DiLoCo and final averaging do; ddp does not), and
    the values of the state that view their memory are kept once per rank.
    """
    if group is None:
        return None
    tensors = optimizer.per_replica_tensors()
    if not tensors:
        return None
    is_replica = same_memory(tensors)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    return lambda state: split_replicas(state, is_replica, rank, world_size)


def _async_workers() -> tuple[DefaultStager, ThreadPoolExecutor]:
    """The process's staging copier and its upload thread, made once.

    What ``dcp.async_save`` does, with both threads kept: it starts a new upload thread per
    save, and starting a thread on a busy machine blocked the caller for tens of ms here. The
    stager also keeps its CPU copies between saves (at most one in flight), so no save after the
    first allocates.
    """
    state = current_session().checkpoint
    with state.lock:
        if state.workers is None:
            stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=False))
            uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relay-ckpt-upload")
            for pool in (stager._staging_executor, uploader):  # start both threads now, not on a save
                if pool is not None:
                    pool.submit(lambda: None).result()
            state.workers = (stager, uploader)
        return state.workers


def _report_failure(pending: PendingSave, future: Future) -> None:
    error = future.exception()
    if error is not None:
        log.error("async checkpoint of step %d at %s failed (raised by the next save or wait_for_checkpoint): %s",
                  pending.step, pending.url, error)


def load_checkpoint(target: Callable[[], LoadTarget | None] | None = None) -> tuple[Any, int] | None:
    """(state, step) of the newest checkpoint that verifies, or None when there is none.

    Call it on every rank (collective). Tensors land on the CPU (``load_state_dict`` moves
    them). Corrupt ones are skipped with a warning naming each and why. ``target``, called once
    a checkpoint verified, gives where its tensors go for a sharded load (``TrainState.restore``
    passes one under fsdp: each rank reads only its shards; see checkpoint_dcp).
    """
    wait_for_checkpoint()
    _writes, group = _save_group()
    ctx = current_session().known_context()

    def decode(checkpoints: CheckpointStore, name: str, group: Any) -> dict:
        return decode_files(checkpoints, name, group, rank=ctx.rank, world_size=ctx.world_size,
                            target=target() if target is not None else None)

    loaded = job_checkpoints().load(decode=decode, group=group)
    return None if loaded is None else (loaded.state, loaded.step)


def is_checkpoint_step(step: int, policy: CheckpointPolicy) -> bool:
    """Whether ``policy`` (``checkpoint.every_steps``) asks for a checkpoint at ``step``. Pure."""
    every = policy.every_steps
    return every > 0 and step > 0 and step % every == 0


def checkpoint_due(step: int) -> bool:
    """True when the job's policy asks for a checkpoint at ``step``, or once a stop was requested.

    Not a plain question: it polls the stop request (``poll_stop_for_checkpoint``:
    collective when distributed, so call it on every rank at every step) and marks the loop as
    one that polls, so SIGTERM from then on waits for the loop instead of ending the process
    (``train.preempt``). The policy alone is ``is_checkpoint_step``.
    """
    mark_cooperative()
    if poll_stop_for_checkpoint():
        return True  # the platform asked this worker to stop: commit what it has first
    return is_checkpoint_step(step, current_session().known_context().checkpoint)
