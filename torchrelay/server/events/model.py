"""One event as consumers see it, and the order rules. Pure.

An event is a row of the store's job events (``store.EventRow``: a job's state change with its
reason, a placement, a restart, a stop request). ``seq`` is the row's id: increasing in the
order the server committed them, the same every time a row is read, so a consumer that sees a
``seq`` again drops it (delivery is at least once). ``next_cursor`` is the one rule a relay
moves by: only past events the broker confirmed, in order, never back.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

SCHEMA = 1  # in every body: consumers can tell a later layout


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    seq: int
    time: float
    job_id: str
    state: str
    message: str

    @property
    def kind(self) -> str:
        return "state"

    def routing_key(self) -> str:
        """``job.<id>.state``: a topic exchange binds e.g. ``job.*.state`` or ``job.job-7.#``."""
        return f"job.{self.job_id}.{self.kind}"

    def body(self) -> bytes:
        return json.dumps({"schema": SCHEMA, "seq": self.seq, "time": self.time, "job": self.job_id,
                           "kind": self.kind, "state": self.state, "message": self.message},
                          separators=(",", ":")).encode()

    @classmethod
    def from_body(cls, data: bytes) -> "Event":
        d = json.loads(data)
        return cls(seq=d["seq"], time=d["time"], job_id=d["job"], state=d["state"], message=d["message"])


def next_cursor(cursor: int, batch: Sequence[Event], confirmed: int) -> int:
    """The cursor after the first ``confirmed`` events of ``batch`` (read after ``cursor``, in
    ``seq`` order) were confirmed by the broker. Raises ``ValueError`` on a batch out of order
    or at or before the cursor: a relay that sent such a batch would break the order promise."""
    previous = cursor
    for event in batch:
        if event.seq <= previous:
            raise ValueError(f"event seq {event.seq} follows {previous}: a batch must be in increasing seq order "
                             f"after the cursor {cursor}")
        previous = event.seq
    if not 0 <= confirmed <= len(batch):
        raise ValueError(f"confirmed={confirmed} is not within the batch of {len(batch)}")
    return batch[confirmed - 1].seq if confirmed else cursor
