"""The protocol of a data source whose position is part of a checkpoint: ``ResumableStream``.

``TrainState`` (train.checkpoint_state) saves and restores any loader that has these three
methods, per rank, instead of replaying the batches already trained:

- ``set_epoch(epoch)``: called by ``TrainState.epochs()`` before each epoch. Moving to another
  epoch starts it from its beginning; the epoch the stream already is in (after
  ``load_state_dict``) is left where it is.
- ``state_dict() -> dict``: where the stream is: what it has *yielded* so far (a batch handed
  to the training loop counts as trained once the next checkpoint is taken after it), as plain
  values (ints, floats, strings, lists, dicts of them) — a checkpoint stores them as they are.
- ``load_state_dict(state)``: continue after that point: the next iteration yields the batch
  that would have followed. Raises ``ValueError`` naming what differs when ``state`` belongs to
  another dataset or world size, rather than repeat or skip data.

``torchrelay.train.stream.ShardStream`` implements it over shard files in any store; a message
stream (Kafka offsets, a RabbitMQ delivery position) implements the same three methods. A stream
that cannot seek raises from ``load_state_dict``. Nothing else is asked of it: it is iterable.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class ResumableStream(Protocol):
    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def is_resumable(loader: Any) -> bool:
    """Whether ``loader`` keeps its own position (``ResumableStream``). A torch ``DataLoader`` does not."""
    return isinstance(loader, ResumableStream)
