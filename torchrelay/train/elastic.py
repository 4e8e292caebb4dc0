"""Elastic data parallel: the job's workers may die or join while it runs, and the others go on.

``strategy: {kind: ddp, elastic: {min_workers, max_workers}}``. When a member dies (any
signal), the collective of the step it was in fails on the others within milliseconds (gloo
sees the closed sockets); they meet in the job's store, form the next membership epoch with
a process group of their own over the same store, take the in-memory state of the survivor
that completed the fewest steps, and redo that step with the global batch split among them.
No one restarts, nothing is loaded from a checkpoint. A joiner registers in the store; the
members admit it at the next step boundary, and it receives the parameters, optimizer state
and step from a member.

Why by hand: ``torchrun`` restarts every worker on any failure (torchelastic); ``torchft``
(the model for this) needs its lighthouse service and its own managers. This keeps the job's
one store (the agent's, which outlives any rank: ``torchrelay.agent.warm`` hosts it outside
the ranks, as torchrun's agent does) and one gloo group per epoch (``ProcessGroupGloo``
directly: a group that is not torch.distributed's default can be dropped and replaced
without touching global state). The decisions are ``elastic_plan``'s (pure).

Contract:
- ``ElasticGroup.from_env(min_workers=, max_workers=)``: a worker started with the job
  (``RANK`` is its member id, ``WORLD_SIZE`` members at first), the store at
  ``MASTER_ADDR:MASTER_PORT`` (it must be hosted outside the ranks: a warm launch's or
  torchrun's); the range defaults to ``RELAY_STRATEGY``'s. With ``RELAY_ELASTIC_JOIN=1`` (a
  worker the platform started to grow a running job) it joins instead, ``RANK`` its member id
  (past every rank the job used). ``ElasticGroup.join(store, member, ...)``: a worker that
  joins a running job (blocks until admitted).
- ``JobEnded`` (a ``SystemExit`` with code 0): a joiner found the job over, its store gone
  (or not answering within 20 s when it starts), before it was admitted or received the
  members' state; an unchanged script ends with success: there is nothing left to join.
- ``all_reduce_gradients(parameters, steps_done) -> bool``: the mean of the members'
  gradients over the global batch (each member's loss must be its samples' sum divided by the
  global batch: the sum of the members' gradients is then the global batch's mean gradient).
  False when the membership changed instead (this member's gradients are stale: zero them,
  call ``sync_state``, redo the step). Raises ``TooFewMembers`` below ``min_workers``,
  ``MembershipLost`` when this member was left out.
- ``all_reduce_(flat, steps_done) -> bool``: the same for any 1-D tensor (summed in place):
  what ``elastic_sync`` (local SGD and DiLoCo over membership epochs) averages with.
- ``step_done(steps_done)``: at a step boundary; admits waiting joiners when the group agreed
  to (the decision rides in the gradient all-reduce: no extra collective per step), in the
  order they came, as many as ``max_workers`` leaves room for; the others wait for a later one.
- ``needs_sync`` / ``sync_state(state)``: after a change every member calls ``sync_state`` with
  its state (tensors, state dicts and plain values: it is loaded with ``weights_only=True``; a
  joiner passes None) and gets the source member's back. ``batch_range(num_samples, global_batch, step)``: this member's samples.
- ``history``: the ``elastic_plan.Membership`` of every epoch this member was in.
"""
from __future__ import annotations

import datetime
import io
import json
import os
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from torchrelay.errors import InvalidSpec
from torchrelay.train.elastic_plan import (Membership, TooFewMembers, after_failure, after_join, member_range,
                                           state_source)

__all__ = ["ElasticGroup", "JobEnded", "MembershipLost", "TooFewMembers"]

PREFIX = "relay-elastic"
JOIN_VAR = "RELAY_ELASTIC_JOIN"  # set by the server for the workers of a grown job (torchrelay.server.assignment)


class MembershipLost(RuntimeError):
    """This member is not in the group's current membership (it was taken for dead)."""


class JobEnded(SystemExit):
    """A joiner found the job over before it was admitted or got the members' state: exits 0."""

    def __init__(self, message: str):
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _store_gone(store: dist.Store) -> bool:
    """Whether the job's store no longer answers (its host, node 0's launch, has ended)."""
    try:
        store.add("relay-elastic-alive", 0)
        return False
    except RuntimeError:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        return True


def _range_from_env() -> tuple[int, int]:
    try:
        elastic = json.loads(os.environ.get("RELAY_STRATEGY") or "{}").get("elastic") or {}
        return int(elastic["min_workers"]), int(elastic["max_workers"])
    except (ValueError, KeyError, AttributeError, TypeError):
        raise InvalidSpec("the job's strategy has no elastic range; give strategy: {kind: ddp (or local_sgd, "
                          "diloco), elastic: {min_workers: M, max_workers: N}}, or min_workers= and max_workers=") from None


class ElasticGroup:
    """One member's view of the elastic group (see the module docstring). Not thread-safe."""

    def __init__(self, store: dist.Store, member: int, membership: Membership, *, min_workers: int,
                 max_workers: int, timeout_s: float = 30.0, settle_s: float = 0.1, admitted: int = 0):
        self.store = dist.PrefixStore(PREFIX, store)
        self.member = member
        self.min_workers, self.max_workers = min_workers, max_workers
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.settle_s = settle_s
        self.history: list[Membership] = []
        self.needs_sync = False
        self._source = membership.members[0]
        self._admitted = admitted  # joiners admitted so far (the store's joiner list is append-only)
        self._admit_next = 0
        self._pg = None
        self._joining = False  # a joiner until it received the members' state
        self._enter(membership)

    # ------------------------------------------------------------ joining

    @classmethod
    def from_env(cls, min_workers: int | None = None, max_workers: int | None = None,
                 **kw) -> "ElasticGroup":
        if min_workers is None or max_workers is None:
            min_workers, max_workers = _range_from_env()
        joiner = os.environ.get(JOIN_VAR) == "1"
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        try:
            store = dist.TCPStore(*address, is_master=False, timeout=datetime.timedelta(seconds=20 if joiner else 60))
        except RuntimeError:
            if not joiner:
                raise
            raise JobEnded(f"member {os.environ['RANK']}: the job's store at {address[0]}:{address[1]} does not "
                           f"answer: the job ended; nothing to join") from None
        if joiner:
            return cls.join(store, int(os.environ["RANK"]), min_workers=min_workers, max_workers=max_workers, **kw)
        world = int(os.environ["WORLD_SIZE"])
        first = Membership(0, 0, tuple(range(world)))
        return cls(store, int(os.environ["RANK"]), first, min_workers=min_workers, max_workers=max_workers, **kw)

    @classmethod
    def join(cls, store: dist.Store, member: int, *, min_workers: int, max_workers: int,
             timeout_s: float = 30.0, wait_s: float = 300.0, **kw) -> "ElasticGroup":
        """Register ``member`` as a joiner and block until a membership epoch admits it. Raises
        ``JobEnded`` when the store goes away first (the job ended), ``TimeoutError`` after ``wait_s``."""
        prefixed = dist.PrefixStore(PREFIX, store)
        slot = prefixed.add("joiners/next", 1)
        prefixed.set(f"joiners/{slot}", str(member))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                epoch = prefixed.add("latest", 0)
                record = json.loads(prefixed.get(f"epoch/{epoch}")) if epoch else None
            except RuntimeError:
                if not _store_gone(store):
                    raise
                raise JobEnded(f"member {member}: the job ended before it was admitted; nothing to join") from None
            if record and member in record["members"]:
                group = cls(store, member, Membership.from_json(record), min_workers=min_workers,
                            max_workers=max_workers, timeout_s=timeout_s, admitted=record["admitted"], **kw)
                group.needs_sync = group._joining = True
                return group
            time.sleep(0.02)
        raise TimeoutError(f"member {member} was not admitted within {wait_s:g} s")

    # ------------------------------------------------------------ the epoch

    @property
    def membership(self) -> Membership:
        return self.history[-1]

    @property
    def rank(self) -> int:
        return self.membership.rank_of(self.member)

    @property
    def size(self) -> int:
        return len(self.membership.members)

    def _enter(self, membership: Membership) -> None:
        if self.member not in membership.members:
            raise MembershipLost(f"member {self.member} is not in epoch {membership.epoch}'s members "
                                 f"{list(membership.members)}")
        self._pg = None  # the old group's sockets close now: peers still inside it fail at once
        self.history.append(membership)
        store = dist.PrefixStore(f"pg/{membership.epoch}", self.store)
        self._pg = dist.ProcessGroupGloo(store, membership.rank_of(self.member), len(membership.members),
                                         self.timeout)

    def batch_range(self, num_samples: int, global_batch: int, step: int) -> tuple[int, int]:
        """This member's ``(start, stop)`` into the epoch's order at ``step`` (0-based in the epoch)."""
        return member_range(num_samples, global_batch, step, self.membership.members, self.member)

    # ------------------------------------------------------------ steps

    def all_reduce_gradients(self, parameters: Iterable[torch.Tensor], steps_done: int) -> bool:
        """Sum the members' gradients in place (see the module docstring); False if the
        membership changed instead."""
        params = [p for p in parameters if p.grad is not None]
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        if not self.all_reduce_(flat, steps_done):
            return False
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()
        return True

    def all_reduce_(self, flat: torch.Tensor, steps_done: int) -> bool:
        """Sum the 1-D ``flat`` over the members in place; it also carries the count of waiting
        joiners (``step_done`` admits them). False when the membership changed instead: the
        group re-formed with ``steps_done`` as this member's completed steps, ``needs_sync``."""
        rider = torch.zeros(1, dtype=flat.dtype)
        if self.rank == 0:  # the joiners waiting, as member rank 0 sees them: everyone gets its count
            rider[0] = float(self.store.add("joiners/next", 0) - self._admitted)
        both = torch.cat([flat, rider])
        try:
            self._pg.allreduce([both]).wait()
        except RuntimeError:
            self._reform(steps_done)
            return False
        flat.copy_(both[:-1])
        self._admit_next = int(both[-1].item())
        return True

    def step_done(self, steps_done: int) -> None:
        """A step boundary: admit the joiners the last all-reduce agreed on, if any, as many as
        ``max_workers`` leaves room for (the others wait in line for a later boundary: a member
        that is leaving may still hold a place)."""
        current = self.membership
        count = min(self._admit_next, self.max_workers - len(current.members))
        self._admit_next = 0
        if count <= 0:
            return
        key = f"epoch/{current.epoch + 1}"
        if self.rank == 0:
            first = self._admitted + 1
            joiners = [int(self.store.get(f"joiners/{slot}")) for slot in range(first, first + count)]
            nxt = after_join(current, joiners, self.max_workers, steps_done)
            self._publish(nxt, admitted=self._admitted + count)
        nxt, self._admitted = self._wait_epoch(current.epoch + 1, key)
        self._source = current.members[0]
        self._enter(nxt)
        self.needs_sync = True

    def _publish(self, membership: Membership, *, admitted: int) -> bool:
        record = json.dumps({**membership.to_json(), "admitted": admitted})
        won = self.store.compare_set(f"epoch/{membership.epoch}", "", record).decode() == record
        if won:
            self.store.add("latest", membership.epoch - self.store.add("latest", 0))
        return won

    def _wait_epoch(self, epoch: int, key: str) -> tuple[Membership, int]:
        self.store.wait([key], self.timeout)
        record = json.loads(self.store.get(key))
        return Membership.from_json(record), int(record["admitted"])

    def _reform(self, steps_done: int) -> None:
        """After a failed collective: meet the other survivors in the store, form the next epoch."""
        current = self.membership
        self._pg = None
        base = f"reform/{current.epoch}"
        self.store.set(f"{base}/{self.member}", str(steps_done))
        self.store.add(f"{base}/count", 1)
        key = f"epoch/{current.epoch + 1}"
        last, since = -1, time.monotonic()
        deadline = since + self.timeout.total_seconds()
        while not self.store.check([key]):
            arrived = self.store.add(f"{base}/count", 0)
            now = time.monotonic()
            if arrived != last:
                last, since = arrived, now
            elif arrived == len(current.members) or now - since >= self.settle_s:
                committed = {m: int(self.store.get(f"{base}/{m}")) for m in current.members
                             if self.store.check([f"{base}/{m}"])}
                nxt = after_failure(current, committed, self.min_workers)  # raises TooFewMembers
                self._publish(nxt, admitted=self._admitted)
                self.store.set(f"{base}/source", str(state_source(committed)))
                break
            if now > deadline:
                raise TooFewMembers(f"no new membership within {self.timeout.total_seconds():g} s")
            time.sleep(0.005)
        nxt, self._admitted = self._wait_epoch(current.epoch + 1, key)
        self.store.wait([f"{base}/source"], self.timeout)
        self._source = int(self.store.get(f"{base}/source"))
        self._enter(nxt)
        self.needs_sync = True

    # ------------------------------------------------------------ state

    def _wait_store_gone(self) -> bool:
        """Whether the store goes away within the timeout (the members finished)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while time.monotonic() < deadline:
            if _store_gone(self.store):
                return True
            time.sleep(0.05)
        return False

    def sync_state(self, state: object | None) -> object:
        """Everyone's state becomes the source member's (see the module docstring). Blocks."""
        if self._source not in self.membership.members:
            self._source = self.membership.members[0]
        root = self.membership.rank_of(self._source)
        payload = b""
        if self.member == self._source:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            payload = buffer.getvalue()
        length = torch.tensor([len(payload)], dtype=torch.int64)
        try:
            self._pg.broadcast(length, root).wait()
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
                torch.empty(int(length.item()), dtype=torch.uint8)
            self._pg.broadcast(data, root).wait()
        except RuntimeError:
            if self._joining and self._wait_store_gone():  # admitted at the members' last step
                raise JobEnded(f"member {self.member}: the job ended as it was admitted; nothing to join") from None
            raise
        self.needs_sync = self._joining = False
        # weights_only: state dicts, tensors and plain values load; nothing a peer sends can run code here
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)
