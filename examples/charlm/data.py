"""Characters of a text file as token ids, with reproducible batches.

``CharCorpus.from_file(path)`` reads UTF-8 text; the vocabulary is the sorted set of its
characters; the first 90% is training text, the rest validation. ``train_batch(step, rank)``
is a pure function of (seed, step, rank): every run, restart or strategy sees the same
windows, and ranks see different ones. ``val_batches`` are fixed, evenly spaced windows.
``stdlib_text()`` is a text every Python installation ships (the standard library's own
sources and documentation topics, about 1.2 MB): what the benchmarks and tests learn.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch


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
