"""Characters of a text file as token ids, with reproducible batches.

``CharCorpus.from_file(path)`` reads UTF-8 text; the vocabulary is the sorted set of its
characters; the first 90% is training text, the rest validation. ``train_batch(step, rank)``
is a pure function of (seed, step, rank): every run, restart or strategy sees the same
windows, and ranks see different ones. ``val_batches`` are fixed, evenly spaced windows.
``stdlib_text()`` is a text every Python installation ships (the standard library's own
sources and documentation topics, about 1.2 MB): what the benchmarks and tests learn.

In a store (``pack.py``, ``train.py --data URL``): ``pack_corpus`` cuts both splits into
consecutive windows (``text_windows``) and writes them as shard datasets with
``torchrelay.shards.pack``: the training windows at the URL itself, the validation windows at
``URL/val``, and the vocabulary last, as ``URL/corpus.json`` (a store without it is refused:
its packing did not finish). ``read_vocabulary`` and ``stored_val_batches`` read them back
(through ``rt.stream``, so with its store options and disk cache).
"""
from __future__ import annotations

import importlib.util
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

import torchrelay.train as rt
from torchrelay.errors import InvalidSpec, NotFound
from torchrelay.shards import pack
from torchrelay.storage import ArtifactStore

STORE_VOCABULARY = "corpus.json"  # {"chars", "context", "windows": {"train", "val"}}; written last


@dataclass(kw_only=True, slots=True)
class CharCorpus:
    chars: str
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def from_text(cls, text: str, val_fraction: float = 0.1) -> "CharCorpus":
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
        chars = "".join(sorted(set(text)))
        lookup = {c: i for i, c in enumerate(chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - val_fraction))
        return cls(chars=chars, train=ids[:cut], val=ids[cut:])

    @classmethod
    def from_file(cls, path: str | Path, val_fraction: float = 0.1) -> "CharCorpus":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--data {str(path)!r} is not a file; give a UTF-8 text file, "
                                    "e.g. one of Python's own sources")
        return cls.from_text(path.read_text(encoding="utf-8"), val_fraction)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)

    def train_batch(self, step: int, rank: int, *, batch_size: int, context: int,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, context): random windows fixed by (seed, step, rank)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank)
        starts = torch.randint(len(self.train) - context - 1, (batch_size,), generator=gen)
        return _windows(self.train, starts, context)

    def val_batches(self, *, batch_size: int, context: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``batches`` fixed batches of evenly spaced validation windows."""
        count = batch_size * batches
        starts = torch.linspace(0, len(self.val) - context - 2, count).long()
        return [_windows(self.val, starts[i:i + batch_size], context) for i in range(0, count, batch_size)]


def _windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.arange(context + 1)
    rows = ids[starts[:, None] + offsets]
    return rows[:, :-1], rows[:, 1:]


def text_windows(ids: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(windows, starts): ``ids`` cut into consecutive windows of ``context + 1`` ids that
    overlap by one (inputs ``w[:-1]``, targets ``w[1:]``), so every character but the first is a
    target exactly once; ``starts`` are their offsets in ``ids``. A tail shorter than a window is
    left out. Raises ``ValueError`` when ``ids`` holds no whole window."""
    if context < 1 or len(ids) < context + 1:
        raise ValueError(f"a text of {len(ids)} characters holds no window of context={context} (+1 target); "
                         "give a longer text or a smaller --context")
    windows = ids.unfold(0, context + 1, context)
    return windows, torch.arange(len(windows)) * context


def pack_corpus(corpus: CharCorpus, dest: str, *, context: int, shard_size: str | int = "1MiB",
                storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write ``corpus`` as window shards at the store URL ``dest`` (see the module docstring);
    returns what ``corpus.json`` says. Blocks; raises ``StorageError`` from the store."""
    store = ArtifactStore(dest, storage_options)
    store.delete_prefix(STORE_VOCABULARY)  # a store being repacked is refused until it is whole again
    counts = {}
    for split, where in (("train", dest), ("val", _val_url(dest))):
        windows, starts = text_windows(getattr(corpus, split), context)
        # int32 ids: a quarter of int64's bytes, and any vocabulary fits
        index = pack({"window": windows.to(torch.int32), "start": starts}, where, shard_size=shard_size,
                     storage_options=storage_options)
        counts[split] = index.samples
    meta = {"chars": corpus.chars, "context": context, "windows": counts}
    store.put_bytes(STORE_VOCABULARY, json.dumps(meta).encode())
    return meta


def read_vocabulary(loader: Any) -> dict[str, Any]:
    """``corpus.json`` of the store a ``rt.stream`` reads. Raises ``InvalidSpec`` when missing."""
    try:
        return json.loads(loader.store.get_bytes(STORE_VOCABULARY))
    except NotFound:
        raise InvalidSpec(f"{loader.store.url_of(STORE_VOCABULARY)} is missing: --data must be a text file or a "
                          "store packed by examples/charlm/pack.py (whose packing finished)") from None


def stored_val_batches(url: str, *, batch_size: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``batches`` batches of the validation windows at ``URL/val``, in text order."""
    val = rt.stream(_val_url(url), batch_size=batch_size, shuffle=False, rank=0, world_size=1)
    try:
        return [window_batch(batch) for batch in itertools.islice(val, batches)]
    finally:
        val.close()


def window_batch(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) as token ids, from a batch of stored windows."""
    windows = batch["window"].long()
    return windows[:, :-1], windows[:, 1:]


def _val_url(url: str) -> str:
    return f"{url.rstrip('/')}/val"


# The documentation topics (English prose) and four large pure-Python modules
STDLIB_TEXT_MODULES = ("pydoc_data.topics", "argparse", "inspect", "typing", "difflib")


def stdlib_text(modules: tuple[str, ...] = STDLIB_TEXT_MODULES) -> str:
    """The source files of ``modules``, concatenated: text that ships with Python. Raises
    ``FileNotFoundError`` naming a module whose source this installation lacks."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            raise FileNotFoundError(f"the standard library's {name!r} has no source file here; give --data FILE")
        parts.append(Path(spec.origin).read_text(encoding="utf-8"))
    return "\n".join(parts)
