"""Training data streamed from shard files in any store: ``rt.stream(url, batch_size=…)``.

    loader = rt.stream("s3://data/digits", batch_size=64, shuffle_buffer=2048)
    state = rt.TrainState(model, optimizer, loader)      # the loader's position is checkpointed
    state.restore()
    for epoch in state.epochs(3):
        for batch in state.batches():                    # {field: tensor} or a tuple, as packed
            ...

Contract (``ShardStream``):
- Reads a dataset written by ``torchrelay.shards.pack`` / ``relay data pack`` (its ``index.json``
  at ``url``, refused with ``InvalidSpec`` when missing or malformed) from any store the
  artifact store reads: ``s3://…``, ``hdfs://…``, ``webhdfs://…``, a local or shared folder.
- Each epoch the shards are put in one order (seeded by ``seed`` and the epoch, the same on
  every rank) and cut into one contiguous range of samples per rank (torchrelay.shards.plan):
  every sample is yielded exactly once per epoch across the ranks (``even=True``: every rank
  gets the same count and the last ``samples % world_size`` are left out, for DDP's equal
  steps). Within a rank, samples pass a shuffle buffer of ``shuffle_buffer`` (0: shard order).
- Shards are fetched ahead in ``read_ahead`` background threads, in the order the epoch
  needs them (default: about 64 MiB of shards, 2 to 8 of them: small shards are many requests
  whose latencies only overlap when several are in flight), and kept in a local disk cache
  (``cache_dir``, default ``$RELAY_DATA_CACHE`` or ``~/.cache/torchrelay/shards``; files named
  by their sha256, checked once when fetched, before any sample of the shard is used; the
  least recently used go past ``cache_bytes``). A store that is a local or mounted folder is
  read in place, not cached. Shards are read with ``torch.load(weights_only=True, mmap=True)``.
- It is a ``ResumableStream`` (train.resumable): ``state_dict()`` is the epoch and the samples
  yielded in it; a ``TrainState`` checkpoints it per rank, and a resumed job continues with the
  next batch: no sample repeated or skipped. ``load_state_dict`` raises ``ValueError`` naming
  what differs when the checkpoint is of another dataset, world size, seed or buffer.
- Not thread-safe: one iteration at a time. A store error while reading raises ``StorageError``
  naming the shard's URL.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Mapping, Sequence

import torch

from torchrelay.errors import StorageError
from torchrelay.shards.format import INDEX, ShardEntry, ShardIndex, parse_size
from torchrelay.shards.plan import buffered_order, rank_bounds, rank_spans, read_ahead_for, shard_order
from torchrelay.storage import ArtifactStore
from torchrelay.train.artifacts import store_options
from torchrelay.train.data import data_rank_world

DEFAULT_CACHE = os.path.join("~", ".cache", "torchrelay", "shards")
# a shard is fetched in ranged reads of this size (one GET for shards up to it): read_ahead of them
# in memory at once at most
FETCH_BYTES = 64 << 20
_PLAN_KEYS = ("dataset", "world_size", "rank", "seed", "shuffle_buffer", "shuffle", "even", "batch_size")


def stream(url: str, *, batch_size: int, **options: Any) -> "ShardStream":
    """This rank's ``ShardStream`` over the dataset at ``url`` (see the module docstring)."""
    return ShardStream(url, batch_size=batch_size, **options)


class ShardStream:
    def __init__(self, url: str, *, batch_size: int, shuffle: bool = True, shuffle_buffer: int = 10_000,
                 seed: int = 0, even: bool = False, drop_last: bool = False, read_ahead: int | None = None,
                 cache_dir: str | None = None, cache_bytes: str | int = "20GiB",
                 shares: Sequence[float] | None = None, rank: int | None = None, world_size: int | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (samples per rank per step)")
        if read_ahead is not None and (isinstance(read_ahead, bool) or not isinstance(read_ahead, int)
                                       or read_ahead < 1):
            raise ValueError(f"read_ahead={read_ahead!r} must be an int >= 1 (shards fetched ahead), or None")
        self.store = ArtifactStore(url, _options_for(url, storage_options))
        self.index = ShardIndex.parse(self.store.get_bytes(INDEX), self.store.url_of(INDEX))
        if read_ahead is None:
            read_ahead = read_ahead_for([entry.bytes for entry in self.index.shards])
        self.rank, self.world_size = data_rank_world(rank, world_size)
        self.batch_size, self.shuffle, self.shuffle_buffer, self.seed = batch_size, shuffle, shuffle_buffer, seed
        self.even, self.drop_last, self.shares = even, drop_last, list(shares) if shares is not None else None
        self.read_ahead = read_ahead
        self.cache = None if self.store.local else _DiskCache(
            os.path.expanduser(cache_dir or os.environ.get("RELAY_DATA_CACHE") or DEFAULT_CACHE),
            parse_size(cache_bytes))
        self.epoch, self.samples_done = 0, 0
        self._plan: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._pool = ThreadPoolExecutor(max_workers=read_ahead, thread_name_prefix="relay-shards")

    def __repr__(self) -> str:
        return f"ShardStream({self.store.url!r}, rank {self.rank} of {self.world_size})"

    # ------------------------------------------------------------ ResumableStream

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.samples_done = epoch, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "samples": self.samples_done, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self._identity()
        differ = [f"{k}: checkpoint {state.get(k)!r}, now {mine[k]!r}" for k in _PLAN_KEYS if state.get(k) != mine[k]]
        if differ:
            raise ValueError(f"the checkpointed position of {self.store.url} is of another plan ({'; '.join(differ)}); "
                             "resuming there would repeat or skip samples")
        self.epoch, self.samples_done = int(state["epoch"]), int(state["samples"])

    def _identity(self) -> dict[str, Any]:
        return {"dataset": self.index.identity(), "world_size": self.world_size, "rank": self.rank,
                "seed": self.seed, "shuffle_buffer": self.shuffle_buffer, "shuffle": self.shuffle,
                "even": self.even, "batch_size": self.batch_size}

    # ------------------------------------------------------------ the epoch's plan

    def samples_this_epoch(self) -> int:
        return len(self._epoch_plan()[0])

    def __len__(self) -> int:
        count = self.samples_this_epoch()
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

    def _epoch_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(shard, row) of every sample this rank yields this epoch, in order."""
        if self._plan is None or self._plan[0] != self.epoch:
            sizes = self.index.sizes()
            order = shard_order(len(sizes), self.seed, self.epoch, self.shuffle)
            bounds = rank_bounds(sum(sizes), self.world_size, self.shares, self.even)[self.rank]
            spans = rank_spans(sizes, order, bounds)
            shards = torch.cat([torch.full((s.stop - s.start,), s.shard, dtype=torch.int64) for s in spans]) \
                if spans else torch.zeros(0, dtype=torch.int64)
            rows = torch.cat([torch.arange(s.start, s.stop) for s in spans]) if spans else torch.zeros(0, dtype=torch.int64)
            if self.shuffle and self.shuffle_buffer > 1:
                emitted = torch.tensor(buffered_order(len(shards), self.shuffle_buffer,
                                                      f"{self.seed}:{self.epoch}:{self.rank}"), dtype=torch.int64)
                shards, rows = shards[emitted], rows[emitted]
            self._plan = (self.epoch, shards, rows)
        return self._plan[1], self._plan[2]

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        shards, rows = self._epoch_plan()
        total = len(shards)
        if self.samples_done >= total:  # a finished epoch iterated again: a new pass of the same order
            self.samples_done = 0
        window = _Window(self, shards, rows, self.samples_done)
        try:
            for start in range(self.samples_done, total, self.batch_size):
                stop = min(start + self.batch_size, total)
                if self.drop_last and stop - start < self.batch_size:
                    break
                columns = window.gather(start, stop)
                self.samples_done = stop
                yield columns if self.index.kind == "dict" else tuple(columns[str(i)] for i in range(len(columns)))
        finally:
            window.close()

    def load_shard(self, number: int) -> dict[str, torch.Tensor]:
        """The columns of shard ``number`` (fetched into the cache first when the store is remote)."""
        entry = self.index.shards[number]
        path = self.store.full_path(entry.name) if self.cache is None else self.cache.fetch(self.store, entry)
        try:
            return torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        except (OSError, RuntimeError) as exc:
            raise StorageError(f"cannot read shard {self.store.url_of(entry.name)}: {exc}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _Window:
    """The shards one pass needs, fetched ahead in the order it needs them and dropped after their last use."""

    def __init__(self, owner: ShardStream, shards: torch.Tensor, rows: torch.Tensor, start: int):
        self.owner, self.shards, self.rows = owner, shards, rows
        rest = shards[start:]
        unique, inverse = torch.unique(rest, return_inverse=True)
        positions = torch.arange(start, start + len(rest))
        first = torch.full((len(unique),), len(shards), dtype=torch.int64).scatter_reduce(0, inverse, positions, "amin")
        last = torch.zeros(len(unique), dtype=torch.int64).scatter_reduce(0, inverse, positions, "amax")
        by_first = torch.argsort(first)
        self.needed = unique[by_first].tolist()  # shards in the order of their first use
        self.first = first[by_first].tolist()
        self.last_use = dict(zip(unique.tolist(), last.tolist()))
        self.next_fetch = 0
        self.loading: dict[int, Future] = {}
        # samples in one run of the same shard share a run number: a batch within one run is gathered directly
        changes = shards[1:] != shards[:-1]
        self.run = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(changes, 0)]) if len(shards) else shards

    def gather(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        self._fetch_through(stop)
        if self.run[start] == self.run[stop - 1]:  # one shard: rows picked in batch order, nothing to reorder
            out = {key: column.index_select(0, self.rows[start:stop])
                   for key, column in self.loading[int(self.shards[start])].result().items()}
            self._drop_done(stop)
            return out
        shards, rows = self.shards[start:stop], self.rows[start:stop]
        # one index_select per shard and field, in shard order, then one scatter back to batch order
        order = torch.argsort(shards, stable=True)
        groups, counts = torch.unique_consecutive(shards[order], return_counts=True)
        sorted_rows = rows[order]
        pieces: dict[str, list[torch.Tensor]] = {}
        offset = 0
        for shard, count in zip(groups.tolist(), counts.tolist()):
            picked = sorted_rows[offset:offset + count]
            for key, column in self.loading[shard].result().items():
                pieces.setdefault(key, []).append(column.index_select(0, picked))
            offset += count
        out = {}
        for key, parts in pieces.items():
            gathered = parts[0] if len(parts) == 1 else torch.cat(parts)
            out[key] = torch.empty_like(gathered)
            out[key][order] = gathered
        self._drop_done(stop)
        return out

    def _drop_done(self, stop: int) -> None:
        for shard in [s for s in self.loading if self.last_use[s] < stop]:
            del self.loading[shard]  # its last sample is out: the mapping goes with the last reference

    def _fetch_through(self, stop: int) -> None:
        """Start fetching every shard first used before ``stop``, and ``read_ahead`` more."""
        due = sum(1 for first in self.first[self.next_fetch:] if first < stop) + self.next_fetch
        target = min(len(self.needed), due + self.owner.read_ahead)
        while self.next_fetch < target:
            shard = self.needed[self.next_fetch]
            self.loading[shard] = self.owner._pool.submit(self.owner.load_shard, shard)
            self.next_fetch += 1

    def close(self) -> None:
        for future in self.loading.values():
            future.cancel()
        self.loading.clear()


class _DiskCache:
    """Shards on this host's disk, named by their sha256; the least recently used go past ``limit`` bytes."""

    def __init__(self, folder: str, limit: int):
        self.folder, self.limit = folder, limit
        os.makedirs(folder, exist_ok=True)

    def fetch(self, store: ArtifactStore, entry: ShardEntry) -> str:
        path = os.path.join(self.folder, f"{entry.sha256}.pt")
        with contextlib.suppress(FileNotFoundError):
            if os.path.getsize(path) == entry.bytes:
                os.utime(path)  # recently used
                return path
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.part"
        try:
            with open(tmp, "wb") as out:
                hasher = hashlib.sha256()
                for start in range(0, entry.bytes, FETCH_BYTES):  # ranged GETs: no HEAD, no buffered-file copies
                    piece = store.get_range(entry.name, start, min(start + FETCH_BYTES, entry.bytes))
                    hasher.update(piece)
                    out.write(piece)
                    if not piece:
                        break  # the store's object is shorter than the index says: the digest tells
            digest = hasher.hexdigest()
            if digest != entry.sha256:
                raise StorageError(f"shard {store.url_of(entry.name)} has sha256 {digest[:12]}…, its index says "
                                   f"{entry.sha256[:12]}… (changed after it was packed?)")
            os.replace(tmp, path)  # whole or not at all
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self._evict(keep=path)
        return path

    def _evict(self, keep: str) -> None:
        files = []
        for name in os.listdir(self.folder):
            full = os.path.join(self.folder, name)
            with contextlib.suppress(FileNotFoundError):
                if name.endswith(".pt"):
                    stat = os.stat(full)
                    files.append((stat.st_mtime, stat.st_size, full))
        total = sum(size for _, size, _ in files)
        for _mtime, size, full in sorted(files):
            if total <= self.limit:
                break
            if full != keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(full)  # a reader that mapped it keeps its pages
                total -= size


def _options_for(url: str, given: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The options given, else the job store's public ones when the dataset is in the same kind of store."""
    if given is not None:
        return given
    job_url = os.environ.get("RELAY_STORE_URL", "")
    same_scheme = "://" in url and job_url.split("://", 1)[0] == url.split("://", 1)[0]
    return store_options(os.environ) if same_scheme else {}
