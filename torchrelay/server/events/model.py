"""One event as consumers see it, and the order rules. Pure.

Three feeds, each a table of the store read in id order: ``state`` (job events,
``store.EventRow``: a job's state change with its reason, a placement, a restart, a stop
request, and a checkpoint commit, the one event of that feed with ``kind`` ``checkpoint``:
its ``step``, ``attempt`` and ``url``), ``node`` (``store.NodeEventRow``: a node registered,
lost, back) and ``metrics`` (summaries of ``store.MetricRow`` per job, ``metric_summaries``).
``seq`` is the row's id (a summary's: its last row's): increasing within a feed in the order
the server committed them, the same every time a row is read, so a consumer that sees a
``(kind, seq)`` again drops it (delivery is at least once). ``next_cursor`` is the one rule a relay moves by: only past
events the broker confirmed, in order, never back.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SCHEMA = 1  # in every body: consumers can tell a later layout


FEEDS = ("state", "node", "metrics")  # each with its own seq space and cursor
MAX_URL = 2048  # a checkpoint's URL, as its workers name it


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """One event of a feed: ``state`` (a job's event row: state change, placement, restart,
    stop request; ``job_id``, ``state``, ``message``), ``checkpoint`` (a job's event row too: a
    checkpoint its workers committed; also ``step``, ``attempt`` and ``url``, where it lies as
    the workers wrote it), ``node`` (a node's state change: ``node``, ``state``) or ``metrics``
    (a job's metric summary: ``job_id``, ``step``, ``values``, the latest point of each rank
    that reported since the last summary, averaged)."""

    seq: int
    time: float
    kind: str = "state"
    job_id: str = ""
    node: str = ""
    state: str = ""
    message: str = ""
    step: int | None = None
    values: dict[str, float] | None = None
    attempt: int | None = None
    url: str = ""

    def routing_key(self) -> str:
        """``job.<id>.state``, ``job.<id>.checkpoint``, ``job.<id>.metrics`` or
        ``node.<name>.state``: a topic exchange binds e.g. ``job.*.state``, ``job.job-7.#`` or ``node.#``."""
        if self.kind == "node":
            return f"node.{self.node}.state"
        return f"job.{self.job_id}.{self.kind}"

    def key(self) -> str:
        """What keeps a subject's events in order in Kafka: the job id, or the node's name."""
        return self.node if self.kind == "node" else self.job_id

    def body(self) -> bytes:
        out: dict = {"schema": SCHEMA, "seq": self.seq, "time": self.time, "kind": self.kind}
        if self.kind == "node":
            out.update(node=self.node, state=self.state)
        elif self.kind == "metrics":
            out.update(job=self.job_id, step=self.step, values=self.values)
        elif self.kind == "checkpoint":
            out.update(job=self.job_id, state=self.state, message=self.message, step=self.step,
                       attempt=self.attempt, url=self.url)
        else:
            out.update(job=self.job_id, state=self.state, message=self.message)
        return json.dumps(out, separators=(",", ":")).encode()

    @classmethod
    def from_body(cls, data: bytes) -> "Event":
        d = json.loads(data)
        return cls(seq=d["seq"], time=d["time"], kind=d.get("kind", "state"), job_id=d.get("job", ""),
                   node=d.get("node", ""), state=d.get("state", ""), message=d.get("message", ""),
                   step=d.get("step"), values=d.get("values"), attempt=d.get("attempt"), url=d.get("url", ""))


def job_event(seq: int, job_id: str, time: float, state: str, message: str, kind: str | None,
              detail: dict[str, Any] | None) -> Event:
    """The event of one job event row: ``checkpoint`` (its ``detail``'s step, attempt and url)
    when the row is a commit, else ``state``."""
    if kind == "checkpoint" and detail:
        return Event(seq=seq, time=time, kind="checkpoint", job_id=job_id, state=state, message=message,
                     step=detail.get("step"), attempt=detail.get("attempt"), url=detail.get("url", ""))
    return Event(seq=seq, time=time, job_id=job_id, state=state, message=message)


def checkpoint_message(step: int, attempt: int, url: str) -> str:
    """What ``relay status`` shows for a checkpoint commit (the event row's message)."""
    return f"checkpoint of step {step} committed by attempt {attempt}: {url}"


def checkpoint_detail(step: Any, attempt: int, url: Any) -> dict[str, Any]:
    """The ``detail`` a checkpoint commit's event row keeps (``{"step", "attempt", "url"}``).
    Raises ``ValueError`` naming a step that is not an int >= 0, or a URL that is not a
    non-empty line of at most ``MAX_URL`` characters."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step {step!r} must be an int >= 0")
    if not isinstance(url, str) or not url or len(url) > MAX_URL or not url.isprintable():
        raise ValueError(f"checkpoint url {url!r:.300} must be a non-empty printable line of at most "
                         f"{MAX_URL} characters (where the checkpoint's folder lies)")
    return {"step": step, "attempt": int(attempt), "url": url}


def metric_summaries(points: Sequence[tuple[int, str, int, int, float, dict]]) -> list[Event]:
    """One ``metrics`` event per job from metric rows ``(id, job_id, rank, step, time, values)``
    (in id order): the latest point of each rank, values averaged over the ranks, the highest
    step; its seq is the job's last row id, so summaries are in seq order by their last row."""
    latest: dict[str, dict[int, tuple[int, int, float, dict]]] = {}
    for row_id, job, rank, step, at, values in points:
        latest.setdefault(job, {})[rank] = (row_id, step, at, values)
    out = []
    for job, ranks in latest.items():
        rows = list(ranks.values())
        names = sorted({k for *_, values in rows for k in values})
        averaged = {k: sum(v[k] for *_, v in rows if k in v) / sum(1 for *_, v in rows if k in v) for k in names}
        out.append(Event(seq=max(r[0] for r in rows), time=max(r[2] for r in rows), kind="metrics", job_id=job,
                         step=max(r[1] for r in rows), values=averaged))
    return sorted(out, key=lambda e: e.seq)


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
