"""torch.distributed.checkpoint storage in an ``ArtifactStore`` folder: parallel raw writes with sha256, safe reads.

One checkpoint folder holds, per rank ``r`` (the rank in the checkpoint's process group)::

    __<r>_<i>.distcp      tensor bytes as they lie in memory (no pickle) and torch.save'd non-tensor values
    .metadata             DCP's ``Metadata`` (pickled by the coordinator, rank 0)

Contract:
- ``StoreWriter`` is a DCP ``StorageWriter``: ``dcp.save``/``dcp.async_save`` plan the save
  (DCP's planner spreads replicated tensors over the ranks, each rank writes its share), each
  rank writes its items into ``threads`` files at once, hashing every chunk as it goes, and
  fsyncs them (local stores). On any other store (S3, HDFS, …) a file is at most
  ``OBJECT_FILE_BYTES`` (more files when the rank holds more, ``threads`` of them in flight),
  gathered into one buffer and sent whole by the store's own writer (``put_bytes``: one PUT,
  or s3fs's concurrent multipart upload), hashed by another thread while it goes: the upload
  is then what a raw ``s3fs.pipe_file`` of the same bytes is, the hash off its critical path,
  and no buffer is copied twice (fsspec's buffered S3 file copies every write, sends one part
  at a time and only once 50 MiB are in). Each file's sha256 and size reach the coordinator inside the
  write results DCP gathers (an extra result per file, taken out again before ``.metadata`` is
  written). The coordinator calls ``on_start()`` before any rank writes (the folder is cleared
  there) and ``on_commit(entries)`` last, with sha256 and size of every file of every rank:
  that is where the caller writes its manifest. Write errors are
  ``StorageError`` naming the file and the cause (DCP reports them on every rank).
- Why not ``FileSystemWriter``: it ``torch.save``s every tensor into the stream (a zip per
  tensor, written through Python file objects) and hashes nothing; measured here single-threaded
  DCP reaches 0.73 of a raw fsync'd write. Raw tensor bytes written by several threads (hashing
  and ``write`` both release the GIL, and one thread's fsync overlaps another's hashing) is
  what bench/checkpoint.py measures against the raw write.
- ``StoreReader`` is the matching ``StorageReader``. Nothing it reads can run code: ``.metadata``
  goes through an unpickler that only builds DCP's metadata classes, tensors are raw bytes
  copied into fresh tensors, non-tensor values load with ``torch.load(weights_only=True)``
  (``SafeLoadPlanner``; DCP's default planner uses ``weights_only=False``; its ``skip`` leaves
  out values a rank does not need, such as other ranks' replicas). Damage it meets is
  ``CheckpointCorrupt``. It does not check checksums: the caller verifies the folder first.
  A read item that wants whole rows of a stored chunk (the first dimension cut, the others
  whole: every FSDP shard of a tensor saved whole or sharded another way) reads only those
  rows' bytes, so loading a shard never holds the whole tensor.
- ``SafeLoadPlanner(target=...)``: a sharded load. ``target(path, stored)`` gives, for a saved
  tensor at ``path`` (the state's keys, e.g. ``("model", "module.0.weight")``), the tensor to
  load it into (an empty DTensor of this rank's shard: DCP then plans reads of this rank's
  slices only, whatever world size saved it), or None to rebuild it whole as before.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import os
import pickle
import posixpath
import threading
from typing import Any, Callable

import torch
from torch.futures import Future  # DCP waits on torch futures (.wait()), not concurrent ones
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from torchrelay.errors import CheckpointCorrupt, NotFound, StorageError
from torchrelay.storage import ArtifactStore, _describe

METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
DIGEST_FQN = "\x00torchrelay-digest/"  # no state key starts with NUL
# 1 MiB: big enough that write() and sha256 release the GIL for long stretches, small enough that
# the chunk write() just read is still in cache when it is hashed (measured here: 8 MiB chunks
# made the whole save about 1.4x slower than 1 MiB ones)
CHUNK_BYTES = 1 << 20
DEFAULT_THREADS = 4
# a file of a non-local store is built in memory before it is sent: ``threads`` of these at once
# bound the extra memory of a save (a single larger tensor makes a file of its own size). Below
# 100 MiB s3fs sends it as one PUT; ``threads`` PUTs at once keep the gateway as busy as a raw
# ``pipe_file``'s concurrent parts do.
OBJECT_FILE_BYTES = 64 << 20


# ---------------------------------------------------------------- pure parts


def item_nbytes(item: WriteItem) -> int:
    """Bytes a write item occupies (tensors: numel × element size; byte values: 0, they are small)."""
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.size:
        numel *= size
    return numel * torch._utils._element_size(item.tensor_data.properties.dtype)


def split_into_files(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """``items`` in at most ``files`` groups of near-equal bytes (largest first into the lightest group).

    Byte values go round-robin. Empty groups are dropped. Pure.
    """
    if files < 1:
        raise ValueError(f"files={files!r} must be >= 1")
    groups: list[list[WriteItem]] = [[] for _ in range(files)]
    loads = [0] * files
    byte_items = [i for i in items if item_nbytes(i) == 0]
    tensor_items = sorted((i for i in items if item_nbytes(i) > 0), key=item_nbytes, reverse=True)
    for n, item in enumerate(byte_items):
        groups[n % files].append(item)
    for item in tensor_items:
        lightest = loads.index(min(loads))
        groups[lightest].append(item)
        loads[lightest] += item_nbytes(item)
    return [g for g in groups if g]


def row_span(sizes: tuple[int, ...], offsets: tuple[int, ...],
             lengths: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first row, rows)`` when the slice ``offsets``/``lengths`` of a row-major tensor of ``sizes``
    is whole rows (only the first dimension cut), so its bytes are one contiguous run; else None. Pure."""
    if not sizes or len(offsets) != len(sizes) or len(lengths) != len(sizes):
        return None
    if any(o != 0 or n != s for o, n, s in zip(offsets[1:], lengths[1:], sizes[1:])):
        return None
    return int(offsets[0]), int(lengths[0])


def file_count(total_bytes: int, threads: int, max_file_bytes: int) -> int:
    """How many files a rank's ``total_bytes`` go into: ``threads``, or more so that each is near
    ``max_file_bytes`` at most. Pure."""
    if threads < 1 or max_file_bytes < 1:
        raise ValueError(f"threads={threads!r} and max_file_bytes={max_file_bytes!r} must be >= 1")
    return max(threads, -(-total_bytes // max_file_bytes))


def digest_entry(data: bytes) -> dict[str, Any]:
    """``{"sha256", "size"}`` of ``data``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


_ALLOWED_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {("torch", "Size"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: any other global is refused before it is touched."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_METADATA_CLASSES:
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # how torch pickles a layout
            return torch.serialization._get_layout
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def load_metadata(data: bytes) -> dcp_metadata.Metadata:
    """DCP ``Metadata`` from ``.metadata`` bytes, building only allowlisted classes. Raises ``CheckpointCorrupt``."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # pickle raises many kinds for damaged input
        raise CheckpointCorrupt(f"{METADATA_FILE} cannot be read safely ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointCorrupt(f"{METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


# ---------------------------------------------------------------- writing


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order, without a copy when it is contiguous on the CPU."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.is_sparse or tensor.is_quantized:
        raise ValueError(f"a {tensor.layout} / quantized tensor cannot be checkpointed as raw bytes")
    flat = tensor.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _write_all(fh: Any, chunk: memoryview) -> None:
    while chunk:
        written = fh.write(chunk)
        chunk = chunk[written:] if written is not None else chunk[len(chunk):]


def _load_sync_file_range() -> Callable[[int, int, int], None]:
    """``sync_file_range(fd, offset, n, SYNC_FILE_RANGE_WRITE)`` from libc, or a no-op where there is none.

    Why: the kernel starts writing dirty pages back only when they are old or many, so without
    this the disk would sit idle while we hash and then take every byte at the final fsync.
    Starting the write-back of each chunk as soon as it is written lets the disk work while
    the CPU hashes; the fsync at the end then waits only for the tail.
    """
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        call = libc.sync_file_range
        call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    except (OSError, AttributeError):
        return lambda fd, offset, nbytes: None
    return lambda fd, offset, nbytes: call(fd, offset, nbytes, 2)  # 2 = SYNC_FILE_RANGE_WRITE, does not wait


_start_writeback = _load_sync_file_range()


def _run_in_threads(calls: list[Callable[[], Any]], limit: int | None = None) -> list[Any]:
    """Each call's result, in order, the calls run by at most ``limit`` threads (None: one each);
    raises the first call's error (the calls not yet started then are not run).

    Plain threads rather than a ``ThreadPoolExecutor``: an async save still writing while the
    interpreter exits must finish, and executors refuse new work once exit has begun.
    """
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException | None] = [None] * len(calls)
    pending = iter(range(len(calls)))
    lock = threading.Lock()

    def run() -> None:
        while True:
            with lock:
                index = next(pending, None)
                if index is None or any(errors):
                    return
            try:
                results[index] = calls[index]()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
                errors[index] = exc

    count = len(calls) if limit is None else max(1, min(limit, len(calls)))
    threads = [threading.Thread(target=run, name=f"relay-ckpt-write-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for error in errors:
        if error is not None:
            raise error
    return results


class StoreWriter(StorageWriter):
    """DCP writer into ``store`` at ``folder`` (a key). One instance per save; see the module docstring."""

    def __init__(self, store: ArtifactStore, folder: str, *, threads: int = DEFAULT_THREADS,
                 on_start: Callable[[], None] | None = None,
                 on_commit: Callable[[dict[str, dict[str, Any]]], None] | None = None):
        super().__init__()
        if threads < 1:
            raise ValueError(f"threads={threads!r} must be >= 1")
        self.store, self.folder, self.threads = store, folder, threads
        self.on_start, self.on_commit = on_start, on_commit
        self.rank = 0
        self.is_coordinator = True

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank") or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self.on_start is not None:
            self.on_start()  # coordinator, before any rank writes
        return [dataclasses.replace(plan, storage_data=f"__{i}_") for i, plan in enumerate(plans)]

    def _path(self, name: str) -> str:
        return self.store.full_path(posixpath.join(self.folder, name))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data
        local = self.store.local
        if local:
            try:
                self.store.fs.makedirs(self._path(""), exist_ok=True)
            except self.store.failures as exc:
                raise StorageError(f"cannot create {self.store.url_of(self.folder)}: {_describe(exc)}") from exc
            files = self.threads
        else:  # an object store has no folders; a file is sent whole (see the module docstring)
            files = file_count(sum(item_nbytes(i) for i in plan.items), self.threads, OBJECT_FILE_BYTES)
        groups = split_into_files(plan.items, files)
        write = self._write_file if local else self._upload_file
        calls = [lambda n=n, items=items: write(f"{prefix}{n}{DATA_SUFFIX}", items, planner)
                 for n, items in enumerate(groups)]
        results: list[WriteResult] = []
        for name, file_results, entry in _run_in_threads(calls, limit=self.threads):
            results.extend(file_results)
            # the file's digest travels to the coordinator with the results (finish() takes it out)
            results.append(WriteResult(index=MetadataIndex(f"{DIGEST_FQN}{name}"), size_in_bytes=0,
                                       storage_data=entry))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    @staticmethod
    def _item_bytes(item: WriteItem, planner: SavePlanner) -> memoryview:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            return memoryview(data.getbuffer())
        try:
            return _tensor_bytes(data)
        except ValueError as exc:
            raise ValueError(f"checkpoint value {item.index.fqn!r}: {exc}") from None

    def _write_file(self, name: str, items: list[WriteItem],
                    planner: SavePlanner) -> tuple[str, list[WriteResult], dict[str, Any]]:
        """A local file: written a chunk at a time, each chunk's write-back started, hashed meanwhile; fsynced."""
        path = self._path(name)
        hasher = hashlib.sha256()
        results: list[WriteResult] = []
        offset = 0
        try:
            with open(path, "wb", buffering=0) as fh:
                for item in items:
                    buffer = self._item_bytes(item, planner)
                    for start in range(0, len(buffer), CHUNK_BYTES):
                        chunk = buffer[start:start + CHUNK_BYTES]
                        _write_all(fh, chunk)
                        _start_writeback(fh.fileno(), offset + start, len(chunk))
                        hasher.update(chunk)  # while the disk takes the chunk
                    results.append(WriteResult(index=item.index, size_in_bytes=len(buffer),
                                               storage_data=(name, offset, len(buffer))))
                    offset += len(buffer)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise StorageError(f"cannot write {self.store.url_of(posixpath.join(self.folder, name))}: "
                               f"{_describe(exc)}") from exc
        return name, results, {"sha256": hasher.hexdigest(), "size": offset}

    def _upload_file(self, name: str, items: list[WriteItem],
                     planner: SavePlanner) -> tuple[str, list[WriteResult], dict[str, Any]]:
        """A file of another store: its bytes gathered once, sent whole by ``put_bytes`` (atomic:
        a failed upload leaves nothing, s3fs aborts its multipart upload) while this thread hashes them."""
        views: list[memoryview] = []
        results: list[WriteResult] = []
        offset = 0
        for item in items:
            buffer = self._item_bytes(item, planner)
            views.append(buffer)
            results.append(WriteResult(index=item.index, size_in_bytes=len(buffer),
                                       storage_data=(name, offset, len(buffer))))
            offset += len(buffer)
        data = b"".join(views)  # the one copy: botocore sends bytes, not memoryviews
        del views
        key = posixpath.join(self.folder, name)
        # hashlib lets go of the GIL: the hash is made while the bytes go
        digest, _ = _run_in_threads([lambda: hashlib.sha256(data).hexdigest(), lambda: self.store.put_bytes(key, data)])
        return name, results, {"sha256": digest, "size": offset}

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
        everything = [r for rank_results in results for r in rank_results]
        entries = {r.index.fqn[len(DIGEST_FQN):]: r.storage_data for r in everything
                   if r.index.fqn.startswith(DIGEST_FQN)}
        metadata.storage_data = {r.index: r.storage_data for r in everything if not r.index.fqn.startswith(DIGEST_FQN)}
        metadata.storage_meta = None
        missing = {location[0] for location in metadata.storage_data.values()} - set(entries)
        if missing:
            raise StorageError(f"checkpoint files {sorted(missing)} of {self.store.url_of(self.folder)} "
                               "have no digest; the save did not finish on every rank")
        metadata_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        self.store.put_bytes(posixpath.join(self.folder, METADATA_FILE), metadata_bytes)
        entries[METADATA_FILE] = digest_entry(metadata_bytes)
        if self.on_commit is not None:
            self.on_commit(entries)

    def storage_meta(self) -> dcp_metadata.StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own; passed explicitly


# ---------------------------------------------------------------- reading


class StoreReader(StorageReader):
    """DCP reader of a checkpoint folder written by ``StoreWriter``. Raises ``CheckpointCorrupt``."""

    def __init__(self, store: ArtifactStore, folder: str):
        super().__init__()
        self.store, self.folder = store, folder
        self.metadata: dcp_metadata.Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        try:
            raw = self.store.get_bytes(posixpath.join(self.folder, METADATA_FILE))
        except NotFound:
            raise CheckpointCorrupt(f"no {METADATA_FILE} in {self.store.url_of(self.folder)}") from None
        return load_metadata(raw)

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self.metadata is not None
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            location = self.metadata.storage_data.get(item.storage_index)
            if not (isinstance(location, tuple) and len(location) == 3):
                raise CheckpointCorrupt(f"{METADATA_FILE} has no valid location for {item.storage_index.fqn!r}")
            by_file.setdefault(location[0], []).append((location, item))
        for name, entries in sorted(by_file.items()):
            path = self.store.full_path(posixpath.join(self.folder, name))
            try:
                with self.store.fs.open(path, "rb") as fh:
                    for (_, offset, length), item in sorted(entries, key=lambda e: e[0][1]):
                        fh.seek(offset)
                        self._load_item(fh, name, offset, length, item, planner)
            except FileNotFoundError:
                raise CheckpointCorrupt(f"checkpoint file {name!r} is missing") from None
            except self.store.failures as exc:
                raise StorageError(f"cannot read {self.store.url_of(posixpath.join(self.folder, name))}: "
                                   f"{_describe(exc)}") from exc
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _load_item(self, fh: Any, name: str, offset: int, length: int, item: Any, planner: LoadPlanner) -> None:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            raw = fh.read(length)
            if len(raw) != length:
                raise CheckpointCorrupt(f"{name!r} ends before the value {fqn!r} (truncated)")
            planner.load_bytes(item, io.BytesIO(raw))
            return
        stored = self.metadata.state_dict_metadata.get(fqn)
        if not isinstance(stored, dcp_metadata.TensorStorageMetadata):
            raise CheckpointCorrupt(f"{METADATA_FILE} has no tensor metadata for {fqn!r}")
        chunk = next((c for c in stored.chunks if tuple(c.offsets) == tuple(item.storage_index.offset or ())), None)
        if chunk is None:
            raise CheckpointCorrupt(f"{METADATA_FILE} has no chunk of {fqn!r} at {item.storage_index.offset}")
        sizes, dtype = tuple(chunk.sizes), stored.properties.dtype
        needed = math.prod(sizes) * torch._utils._element_size(dtype)
        if needed != length:
            raise CheckpointCorrupt(f"{fqn!r} occupies {length} bytes but a {dtype} {sizes} tensor needs {needed}")
        span = row_span(sizes, tuple(item.storage_offsets), tuple(item.lengths))
        if span is not None:  # whole rows: read only their bytes (a shard of a tensor saved whole)
            first, rows = span
            row_bytes = length // sizes[0] if sizes[0] else 0
            fh.seek(offset + first * row_bytes)
            tensor = self._read_tensor(fh, name, fqn, (rows, *sizes[1:]), dtype)
        else:
            tensor = self._read_tensor(fh, name, fqn, sizes, dtype)
            for dim, (start, size) in enumerate(zip(item.storage_offsets, item.lengths)):
                tensor = tensor.narrow(dim, start, size)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointCorrupt(f"{fqn!r} has shape {tuple(tensor.size())}, expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @staticmethod
    def _read_tensor(fh: Any, name: str, fqn: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A fresh ``shape``/``dtype`` tensor filled from ``fh``'s next bytes. Raises ``CheckpointCorrupt`` when short."""
        tensor = torch.empty(shape, dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes and fh.readinto(memoryview(tensor.reshape(-1).view(torch.uint8).numpy())) != nbytes:
            raise CheckpointCorrupt(f"{name!r} ends inside the tensor {fqn!r} (truncated)")
        return tensor

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False


LoadTarget = Callable[[tuple, dcp_metadata.TensorStorageMetadata], "torch.Tensor | None"]


class SafeLoadPlanner(_EmptyStateDictLoadPlanner):
    """Rebuilds the saved state from the metadata (no template needed) and unpickles
    non-tensor values with ``weights_only=True``. (DCP's own ``_EmptyStateDictLoadPlanner`` is
    what ``dcp_to_torch_save`` uses; its ``load_bytes`` would allow any pickle.)

    ``skip(path)``, when given, leaves out the values whose flattened path (a tuple of keys) it
    accepts: another rank's replica entry is not read at all. ``target(path, stored)``, when
    given, names the tensor a saved tensor is loaded into (a sharded load, see the module
    docstring); where it gives None the tensor is rebuilt whole.
    """

    def __init__(self, *args: Any, skip: Callable[[tuple], bool] | None = None,
                 target: LoadTarget | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.skip = skip
        self.target = target

    def set_up_planner(self, state_dict: dict, metadata: dcp_metadata.Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        """The state rebuilt from ``metadata`` (as ``_EmptyStateDictLoadPlanner`` does), each tensor in
        the place ``target`` names or else a fresh whole one."""
        if state_dict or metadata is None:
            raise ValueError("SafeLoadPlanner builds the state itself: pass {} and read the metadata first")
        for key, stored in metadata.state_dict_metadata.items():
            if not self._should_include_key(key, metadata):
                continue
            path = (metadata.planner_data or {}).get(key)
            value: Any = stored
            if isinstance(stored, dcp_metadata.TensorStorageMetadata):
                value = self.target(tuple(path), stored) if self.target is not None and path is not None else None
                if value is None:
                    value = torch.empty(stored.size, dtype=stored.properties.dtype)
            if path is not None:
                set_element(state_dict, path, value)
            else:
                state_dict[key] = value
        DefaultLoadPlanner.set_up_planner(self, state_dict, metadata, is_coordinator)

    def _should_include_key(self, key: str, metadata: dcp_metadata.Metadata) -> bool:
        if self.skip is not None:
            path = (metadata.planner_data or {}).get(key)
            if path is not None and self.skip(tuple(path)):
                return False
        return super()._should_include_key(key, metadata)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as exc:  # UnpicklingError, RuntimeError … for refused or damaged input
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointCorrupt(f"value {read_item.dest_index.fqn!r} cannot be loaded with weights_only=True "
                                    f"({type(exc).__name__}: {first[:200]})") from None
        # what DefaultLoadPlanner.load_bytes does after its own (weights_only=False) torch.load
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
