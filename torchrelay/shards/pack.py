"""Write a dataset into shard files in any store: ``pack(samples, dest, shard_size="64MiB")``.

``samples`` is any of:
- columns: a mapping ``{name: tensor or array of N rows}`` (samples are dicts) or a tuple/list
  of them (``TensorDataset.tensors``; samples are tuples) — sliced without copying row by row;
- a dataset: anything with ``len`` and ``[i]`` or any iterable, whose items are dicts or
  tuples of tensors, arrays or numbers (rows are stacked shard by shard).

Each shard holds about ``shard_size`` bytes of sample data (at least one sample); the index is
written last, after the shards (torchrelay.shards.format). Packing into a folder that holds a
dataset replaces it: its index goes first, so no reader mixes old and new shards. Blocks; raises
``StorageError`` (the store) and ``ValueError`` (samples whose fields or shapes disagree,
naming the sample). ``read_source(path)`` reads what ``relay data pack SRC`` takes: ``.pt``
(a dict or tuple of tensors, loaded with ``weights_only=True``), ``.npz`` or ``.npy``.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import os
from typing import Any, Iterable, Iterator, Mapping

import torch

from torchrelay.errors import NotFound
from torchrelay.shards.format import INDEX, ShardEntry, ShardIndex, parse_size, shard_name
from torchrelay.storage import ArtifactStore


def pack(samples: Any, dest: str, *, shard_size: str | int = "64MiB",
         storage_options: Mapping[str, Any] | None = None) -> ShardIndex:
    """Write ``samples`` as shards and an index at the store URL ``dest``; returns the index."""
    limit = parse_size(shard_size)
    store = ArtifactStore(dest, storage_options)
    _uncommit(store)
    kind, chunks = _column_chunks(samples, limit)
    entries, fields = [], None
    for number, columns in enumerate(chunks):
        fields = fields or {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape[1:])}
                            for name, t in columns.items()}
        buffer = io.BytesIO()
        torch.save(columns, buffer)
        data = buffer.getvalue()
        name = shard_name(number)
        store.put_bytes(name, data)
        entries.append(ShardEntry(name=name, samples=len(next(iter(columns.values()))), bytes=len(data),
                                  sha256=hashlib.sha256(data).hexdigest()))
    if not entries:
        raise ValueError(f"no samples to pack into {dest}")
    index = ShardIndex(kind=kind, fields=fields or {}, shards=tuple(entries))
    store.put_bytes(INDEX, index.to_json())
    return index


def read_source(path: str | os.PathLike) -> Any:
    """The columns in a local ``.pt``, ``.npz`` or ``.npy`` file. Raises ``ValueError`` naming it."""
    path = os.fspath(path)
    if path.endswith(".npz") or path.endswith(".npy"):
        import numpy as np

        loaded = np.load(path, allow_pickle=False)
        return dict(loaded.items()) if path.endswith(".npz") else (loaded,)
    if path.endswith(".pt") or path.endswith(".pth"):
        data = torch.load(path, weights_only=True, map_location="cpu")
        if isinstance(data, (dict, tuple, list)):
            return data
        if isinstance(data, torch.Tensor):
            return (data,)
        raise ValueError(f"{path} holds a {type(data).__name__}; pack takes a dict or tuple of tensors")
    raise ValueError(f"{path}: pack reads .pt (a dict or tuple of tensors), .npz or .npy files")


def _uncommit(store: ArtifactStore) -> None:
    try:
        store.get_bytes(INDEX)
    except NotFound:
        return
    store.delete_prefix(INDEX)
    for key, _size in store.list(""):
        if key.startswith("shard-") and key.endswith(".pt"):
            store.delete_prefix(key)


def _column_chunks(samples: Any, limit: int) -> tuple[str, Iterator[dict[str, torch.Tensor]]]:
    """("dict" | "tuple", shards as {field: tensor}) of about ``limit`` bytes each."""
    if isinstance(samples, Mapping) or (isinstance(samples, (tuple, list)) and samples
                                        and all(_is_array(c) for c in samples)):
        columns = _named(samples)
        rows = {len(c) for c in columns.values()}
        if len(rows) != 1:
            raise ValueError(f"the columns have different numbers of rows: {sorted(rows)}")
        step = _rows_per_shard({k: c[0] for k, c in columns.items()}, limit)
        total = rows.pop()
        kind = "dict" if isinstance(samples, Mapping) else "tuple"
        return kind, ({k: c[i:i + step].clone() for k, c in columns.items()} for i in range(0, total, step))
    items = iter(samples) if not hasattr(samples, "__getitem__") or not hasattr(samples, "__len__") \
        else (samples[i] for i in range(len(samples)))
    first = next(items, None)
    if first is None:
        return "dict", iter(())
    kind = "dict" if isinstance(first, Mapping) else "tuple"
    return kind, _stacked(itertools.chain([first], items), _rows_per_shard(_named(first), limit))


def _stacked(items: Iterable[Any], step: int) -> Iterator[dict[str, torch.Tensor]]:
    batch: list[dict[str, torch.Tensor]] = []
    keys = None
    for number, item in enumerate(items):
        row = _named(item)
        keys = keys or list(row)
        if list(row) != keys:
            raise ValueError(f"sample {number} has the fields {list(row)}, the first had {keys}")
        batch.append(row)
        if len(batch) == step:
            yield _stack(batch)
            batch = []
    if batch:
        yield _stack(batch)


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    out = {}
    for key in rows[0]:
        try:
            out[key] = torch.stack([row[key] for row in rows])
        except RuntimeError as exc:
            raise ValueError(f"field {key!r} has samples of different shapes or types: {exc}") from None
    return out


def _named(sample: Any) -> dict[str, torch.Tensor]:
    if isinstance(sample, Mapping):
        return {str(k): torch.as_tensor(v) for k, v in sample.items()}
    if isinstance(sample, (tuple, list)):
        return {str(i): torch.as_tensor(v) for i, v in enumerate(sample)}
    return {"0": torch.as_tensor(sample)}


def _is_array(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or type(value).__name__ == "ndarray"


def _rows_per_shard(row: dict[str, torch.Tensor], limit: int) -> int:
    per_row = sum(t.numel() * t.element_size() for t in row.values())
    return max(1, limit // max(1, per_row))
