"""Stream datasets, the pure parts: who reads which partition, and where reading resumes.

A stream (a Kafka topic, or RabbitMQ streams) is read as ``partitions`` numbered ``0..P-1``.
- ``assign(partitions, world, rank, workers, worker)``: the partitions one DataLoader worker of
  one rank reads, deterministically and with no consumer-group rebalance ever: rank ``r`` owns
  partitions ``r, r + world, r + 2·world, …``, and its worker ``w`` of ``W`` every ``W``-th of
  those. Raises ``StreamError`` naming the stream and the counts when ``partitions`` cannot be
  split evenly over the ranks (a rank with fewer partitions would run out first and leave its
  peers waiting in a collective), or a rank has fewer partitions than DataLoader workers.
- ``Position``: per partition, the offset of the next record to read; ``advance`` after a
  batch; ``to_state``/``from_state`` for the checkpoint (plain ints, keys as strings).
No I/O, no clock.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from torchrelay.errors import StreamError

__all__ = ["Position", "StreamError", "assign"]


def assign(partitions: int, *, world: int, rank: int, workers: int = 1, worker: int = 0,
           stream: str = "the stream") -> list[int]:
    """The partitions worker ``worker`` (of ``workers``) of rank ``rank`` (of ``world``) reads."""
    if world < 1 or not 0 <= rank < world or workers < 1 or not 0 <= worker < workers:
        raise ValueError(f"rank {rank} of {world}, worker {worker} of {workers}: not a valid place")
    if partitions < world or partitions % world:
        raise StreamError(f"{stream} has {partitions} partition(s), which cannot be split evenly over the job's "
                          f"{world} rank(s); give it a multiple of {world} partitions, or run {world} divides")
    mine = list(range(rank, partitions, world))
    if len(mine) < workers:
        raise StreamError(f"{stream}: each of the {world} rank(s) reads {len(mine)} partition(s), fewer than its "
                          f"{workers} DataLoader workers; use at most {len(mine)} workers or more partitions")
    return mine[worker::workers]


class Position:
    """Where reading resumes: partition -> offset of the next record (missing: the start)."""

    def __init__(self, offsets: Mapping[int, int] | None = None):
        self.offsets: dict[int, int] = {int(p): int(o) for p, o in (offsets or {}).items()}

    def start(self, partition: int, default: int) -> int:
        return self.offsets.get(partition, default)

    def advance(self, consumed: Mapping[int, int]) -> None:
        """``consumed``: partition -> offset of the last record in a batch now trained on. An
        offset never moves back (batches of one partition come in order)."""
        for partition, last in consumed.items():
            nxt = int(last) + 1
            if nxt > self.offsets.get(int(partition), -1):
                self.offsets[int(partition)] = nxt

    def to_state(self) -> dict[str, int]:
        return {str(p): o for p, o in sorted(self.offsets.items())}

    @classmethod
    def from_state(cls, state: Mapping[str, int] | None) -> "Position":
        return cls({int(p): int(o) for p, o in (state or {}).items()})

    def only(self, partitions: Iterable[int]) -> "Position":
        keep = set(partitions)
        return Position({p: o for p, o in self.offsets.items() if p in keep})
