"""One parameter-server shard: holds its bytes of the model, applies updates, answers pulls.

Contract:
- ``ShardState`` is everything a shard knows that must outlive it: parameters, optimizer
  buffers (momentum, or Adam's two moments and step counts), version, every worker's clock
  and done flag. ``ShardState.allocate(..., files)`` maps it from files (/dev/shm) so a
  supervisor can restart a crashed shard process on the very same state.
- ``ShardServer(shard, state, ...)`` binds ``host`` on port 0 (``.port``), and
  ``serve_forever()`` serves one thread per connection until every worker has sent DONE
  (then returns) or ``stop()`` is called. Requests are checked with
  ``protocol.check_request`` before any payload is read; a bad one is answered with ERROR
  and its connection closed, parameters untouched.
- Modes (the server enforces them; workers are not trusted):
  ``sync``  a PUSH with clock c joins round c; when every active worker has pushed, the mean
            gradient is applied once (the ``ddp`` math) and all of them get the new parameters.
  ``async`` a PUSH is applied on arrival and answered at once.
  ``ssp``   as async, but the reply to a worker whose clock is more than ``staleness`` ahead
            of the slowest active worker is held until the slowest catches up.
  Staleness reported per PUSH = the pushing worker's clock minus the slowest active worker's.
  A PUSH repeating the previous clock (a resend after reconnecting) is answered without
  being applied again; any other clock is refused as out of order.
- Overlapped reply: a PUSH is received whole and checked before any byte of it is applied
  (so a payload cut short never touches a parameter). When its reply is due at once (sync:
  the push that completes the round; async), the update then runs chunk by chunk
  (``chunk_bytes``) and a second thread sends the PARAMS header and each chunk's new
  parameters as soon as that chunk is updated: the update and the pull overlap instead of
  following each other. ssp, and a sync push that does not complete its round, reply after
  the whole update as before.
- Shared memory (``protocol`` FLAG_SHM): a connection whose worker ATTACHed its region has its
  gradients read from, and its new parameters written into, the worker's memory; the reply
  header goes out after the last byte is written. The worker's gradient memory is only read:
  in ``sync`` the round's sum is kept in server memory (the first server-owned gradient buffer
  of the round, or this connection's receive buffer), never in a worker's region.
- ``serve_shard_supervised(...)`` is the server rank's loop: it runs the shard in a child
  process, publishes each incarnation's address through the job's store, and restarts a
  child that dies on the shared state. Returns when a child exits 0 (all workers done).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch
from torch.optim.adam import adam as adam_step
from torch.optim.sgd import sgd as sgd_step

from torchrelay.spec import ServerOptimizer
from torchrelay.train.memory import MemoryFigures
from torchrelay.train.ps import protocol as P
from torchrelay.train.ps.plan import Plan, Segment, ShardPlan
from torchrelay.train.ps.rendezvous import ShardDirectory
from torchrelay.train.ps.shm import ShmDeclined, map_worker_region, same_host

_META_VERSION, _META_INITIALISED, _META_TOKEN, _META_FIXED = 0, 1, 2, 3

# Why 1 MiB: the reply can start after the first MiB is updated, and the chunk just written
# is still in cache when the sending thread copies it into the socket. Multiple of
# plan.CUT_ALIGN, so a chunk edge is always an element edge of every segment.
CHUNK_BYTES = 1 << 20


def buffers_for(optimizer: ServerOptimizer) -> tuple[str, ...]:
    """Names of the per-element optimizer buffers, in wire order."""
    if optimizer.name == "adam":
        return ("exp_avg", "exp_avg_sq")
    return ("momentum_buffer",) if optimizer.momentum > 0 else ()


def shard_memory(shard: ShardPlan, buffer_names: tuple[str, ...]) -> MemoryFigures:
    """What a shard's state holds for its whole life (``ShardState``, allocated once): its parameters'
    bytes and its optimizer state (one shard-sized buffer per ``buffer_names``, and the step count
    kept per segment). Gradients are not in it: a push's bytes land in a receive buffer per worker
    connection (TCP) or are read in place (shared memory). Pure."""
    steps = len(shard.segments) * torch.float32.itemsize
    return MemoryFigures(parameters=shard.nbytes, optimizer_state=shard.nbytes * len(buffer_names) + steps)


def typed_views(flat: torch.Tensor, segments: tuple[Segment, ...]) -> list[torch.Tensor]:
    """Typed 1-D views of ``flat`` (uint8) for each segment; they share its memory."""
    return [flat[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)) for s in segments]


@dataclasses.dataclass
class ShardState:
    params: torch.Tensor                 # uint8 [nbytes]
    buffers: list[torch.Tensor]          # uint8 [nbytes] each, see buffers_for
    steps: torch.Tensor                  # float32 [segments]: Adam's per-tensor step counts
    meta: torch.Tensor                   # int64 [3 + 2 * workers]: version, initialised, token, clocks, done

    @staticmethod
    def sizes(shard: ShardPlan, buffer_names: tuple[str, ...], workers: int) -> dict[str, tuple[int, torch.dtype]]:
        """Element count and dtype of every state tensor, by name."""
        out = {"params": (shard.nbytes, torch.uint8), "steps": (len(shard.segments), torch.float32),
               "meta": (_META_FIXED + 2 * workers, torch.int64)}
        out.update({f"buffer{i}": (shard.nbytes, torch.uint8) for i in range(len(buffer_names))})
        return out

    @classmethod
    def allocate(cls, shard: ShardPlan, buffer_names: tuple[str, ...], workers: int,
                 files: dict[str, str] | None = None) -> "ShardState":
        """Zeroed state in private memory; with ``files`` (name -> path of a file of the
        right size, see ``sizes``) every tensor is a shared mapping of that file instead, so
        a restarted shard process maps the very same state."""
        sizes = cls.sizes(shard, buffer_names, workers)

        def make(name: str) -> torch.Tensor:
            count, dtype = sizes[name]
            if files is None or count == 0:
                return torch.zeros(count, dtype=dtype)
            return torch.from_file(files[name], shared=True, size=count, dtype=dtype)

        return cls(params=make("params"), buffers=[make(f"buffer{i}") for i in range(len(buffer_names))],
                   steps=make("steps"), meta=make("meta"))


def chunk_pieces(shard: ShardPlan, chunk_bytes: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
    """Cut the shard's bytes into ``[begin, end)`` chunks of at most ``chunk_bytes``, each with
    the ``(segment index, begin, end)`` byte pieces of segments inside it. Pure. Raises
    ``ValueError`` unless ``chunk_bytes`` is a positive multiple of 16."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of 16")
    out = []
    for begin in range(0, shard.nbytes, chunk_bytes):
        end = min(begin + chunk_bytes, shard.nbytes)
        pieces = [(i, max(begin, s.offset), min(end, s.offset + s.nbytes)) for i, s in enumerate(shard.segments)
                  if s.offset < end and s.offset + s.nbytes > begin]
        out.append((begin, end, pieces))
    return out


class ShardServer:
    """Serves one shard on a fresh port. See the module docstring for the contract."""

    def __init__(self, shard: ShardPlan, state: ShardState, *, num_workers: int, mode: str,
                 staleness: int, optimizer: ServerOptimizer, host: str = "127.0.0.1",
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        if mode not in ("sync", "async", "ssp"):
            raise ValueError(f"mode {mode!r} is not one of sync, async, ssp")
        self.shard, self.state, self.mode = shard, state, mode
        self.num_workers, self.staleness, self.optimizer = num_workers, staleness, optimizer
        self.buffer_names = buffers_for(optimizer)
        self.identity = P.ShardIdentity(shard=shard.index, plan_id=shard.plan_id,
                                        num_workers=num_workers, shard_nbytes=shard.nbytes,
                                        state_nbytes=shard.nbytes * (1 + len(self.buffer_names)))
        self._param_views = typed_views(state.params, shard.segments)
        self._buffer_views = [typed_views(b, shard.segments) for b in state.buffers]
        self._step_views = [state.steps[i:i + 1] for i in range(len(shard.segments))]
        self._chunks = chunk_pieces(shard, chunk_bytes)
        self._agg_views: list[torch.Tensor] = []   # sync: the current round's gradient sum
        self._agg_flat: torch.Tensor | None = None  # ... and the byte buffer they view
        self._agg_borrowed = False          # ... which is a worker's shared region (read only)
        self._pushed: set[int] = set()      # sync: workers in the current round
        self._waiting = 0                   # requests held for a round or the ssp bound
        self._cond = threading.Condition()
        self._stopping = False
        self._connections: set[socket.socket] = set()
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.host, self.port = host, self._listener.getsockname()[1]
        self.updates_applied = 0

    # ------------------------------------------------------------ state helpers (lock held)

    @property
    def version(self) -> int:
        return int(self.state.meta[_META_VERSION])

    def _clock(self, worker: int) -> int:
        return int(self.state.meta[_META_FIXED + worker])

    def _done(self, worker: int) -> bool:
        return bool(self.state.meta[_META_FIXED + self.num_workers + worker])

    def _active(self) -> list[int]:
        return [w for w in range(self.num_workers) if not self._done(w)]

    def _min_active_clock(self) -> int:
        active = self._active()
        return min(self._clock(w) for w in active) if active else self.version

    def _optimizer_math(self, params: list[torch.Tensor], grads: list[torch.Tensor],
                        buffers: list[list[torch.Tensor]], steps: list[torch.Tensor]) -> None:
        """torch.optim's functional SGD / Adam on typed views, so the math is exactly PyTorch's.
        ``buffers[k]`` are the views of optimizer buffer k; Adam increments ``steps``."""
        cfg = self.optimizer
        if not params:
            return
        with torch.no_grad():
            if cfg.name == "adam":
                adam_step(
                    params, grads, buffers[0], buffers[1], [], steps, foreach=False, amsgrad=False,
                    beta1=cfg.betas[0], beta2=cfg.betas[1], lr=cfg.lr, weight_decay=cfg.weight_decay,
                    eps=1e-8, maximize=False)
            else:
                momentum = buffers[0] if buffers else [None] * len(grads)
                sgd_step(
                    params, grads, list(momentum), foreach=False, weight_decay=cfg.weight_decay,
                    momentum=cfg.momentum, lr=cfg.lr, dampening=0.0, nesterov=False, maximize=False)

    def _apply(self, grads: list[torch.Tensor], grad_flat: torch.Tensor | None = None,
               sender: "_ReplySender | None" = None) -> None:
        """One optimizer step of the shard with ``grads`` (typed views of ``grad_flat``).
        With ``sender``: chunk by chunk, handing each updated chunk of the parameters to it
        (then ``grad_flat`` is required). Lock held."""
        if sender is None:
            self._optimizer_math(self._param_views, grads, self._buffer_views, self._step_views)
        else:
            assert grad_flat is not None
            adam = self.optimizer.name == "adam"
            # Adam's step count is per tensor: every chunk computes with count + 1 on a copy of
            # the count before this push; the counts themselves move once, before any chunk is
            # handed to the sender (so the state is final by the time the reply's last byte is).
            counts_before = self.state.steps.clone() if adam else None
            if adam:
                self.state.steps.add_(1.0)
            for begin, end, pieces in self._chunks:
                if pieces:
                    dtypes = [getattr(torch, self.shard.segments[i].dtype) for i, _, _ in pieces]

                    def views(flat: torch.Tensor) -> list[torch.Tensor]:
                        return [flat[lo:hi].view(dt) for (_, lo, hi), dt in zip(pieces, dtypes)]

                    steps = [counts_before[i:i + 1].clone() for i, _, _ in pieces] if adam else []
                    self._optimizer_math(views(self.state.params), views(grad_flat),
                                         [views(b) for b in self.state.buffers], steps)
                sender.put(self.state.params[begin:end])
        self.state.meta[_META_VERSION] += 1
        self.updates_applied += 1

    def _maybe_finish_sync_round(self, sender: "_ReplySender | None" = None) -> bool:
        """Apply the round if every active worker has pushed (lock held). Returns whether it did."""
        active = self._active()
        if not self._pushed or any(w not in self._pushed for w in active):
            return False
        count = len(self._pushed)
        if count > 1 and self._agg_views:
            torch._foreach_div_(self._agg_views, float(count))
        self._apply(self._agg_views, self._agg_flat, sender)
        version = self.version
        for w in range(self.num_workers):
            self.state.meta[_META_FIXED + w] = version
        self._pushed.clear()
        self._cond.notify_all()
        return True

    # ------------------------------------------------------------ serving

    def serve_forever(self) -> None:
        """Accept and serve until all workers are done or ``stop()``. Blocks.

        After the last DONE it waits (up to 30 s) for every connection to finish its reply
        and be closed by its worker, so no worker loses the answer to its DONE.
        """
        threads: list[threading.Thread] = []
        try:
            while not self._stopping:
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    break
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._cond:
                    self._connections.add(conn)
                thread = threading.Thread(target=self._serve_connection, args=(conn,), daemon=True)
                thread.start()
                threads.append(thread)
        finally:
            self._listener.close()
        deadline = time.monotonic() + 30
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        """Stop serving: wake every held request and cut every connection. Idempotent;
        does not block (``serve_forever`` returns soon after)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _serve_connection(self, conn: socket.socket) -> None:
        buffers = _ConnectionBuffers(self.shard)
        try:
            while True:
                try:
                    header = P.recv_header(conn)
                except P.ProtocolError as exc:
                    self._reply_error(conn, str(exc))
                    return
                reason = P.check_request(header, self.identity, buffers.shm_params is not None)
                if reason is not None:
                    self._reply_error(conn, reason)
                    return
                if not self._handle(conn, header, buffers):
                    return
        except (ConnectionError, OSError):
            return
        except Exception as exc:  # a bug must not leave the worker waiting forever
            traceback.print_exc()
            self._reply_error(conn, f"shard {self.shard.index} failed: {exc!r}")
        finally:
            with self._cond:
                self._connections.discard(conn)
            conn.close()

    def _handle(self, conn: socket.socket, h: P.Header, buffers: "_ConnectionBuffers") -> bool:
        """Serve one checked request. Returns False when the connection must close."""
        op = h.op
        if op == P.Op.PUSH:
            if h.flags & P.FLAG_SHM:
                return self._push(conn, h, buffers.shm_grad_views, buffers.shm_grads, buffers)
            P.recv_exact_into(conn, memoryview(buffers.recv.numpy()))
            return self._push(conn, h, buffers.recv_views, buffers.recv, buffers)
        if op == P.Op.ATTACH:
            payload = P.recv_bytes(conn, h.payload_len)
            try:
                if not same_host(conn):
                    raise ShmDeclined("the worker is not on this shard's host")
                params, grads = map_worker_region(payload, self.shard.end)
            except ShmDeclined as exc:
                reason = str(exc).encode()
                self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, self.version, self.shard.plan_id,
                                           len(reason), 0), reason)
                return True
            buffers.attach(params[self.shard.begin:], grads[self.shard.begin:])
            self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, self.version, self.shard.plan_id, 0, 1))
            return True
        if op == P.Op.HELLO:
            with self._cond:
                clock = self.version if self.mode == "sync" else self._clock(h.worker)
                initialised = int(self.state.meta[_META_INITIALISED])
            self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, clock, self.shard.plan_id, 0,
                                       initialised))
            return True
        if op == P.Op.INIT:
            P.recv_exact_into(conn, memoryview(buffers.recv.numpy()))
            with self._cond:
                if not self.state.meta[_META_INITIALISED]:
                    self.state.params.copy_(buffers.recv)
                    self.state.meta[_META_INITIALISED] = 1
                    self._cond.notify_all()
            self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, self.version, self.shard.plan_id))
            return True
        if op == P.Op.PULL:
            shm = buffers.shm_params if h.flags & P.FLAG_SHM else None
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or bool(self.state.meta[_META_INITIALISED]))
                (buffers.send if shm is None else shm).copy_(self.state.params)
                version = self.version
            self._reply(conn, self._params_header(h.worker, version, 0, shm is not None),
                        *(() if shm is not None else (buffers.send,)))
            return True
        if op == P.Op.DONE:
            with self._cond:
                self.state.meta[_META_FIXED + self.num_workers + h.worker] = 1
                if self.mode == "sync":
                    self._maybe_finish_sync_round()
                if not self._active():
                    self._stopping = True
                self._cond.notify_all()
            self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, self.version, self.shard.plan_id))
            return True
        if op == P.Op.GET_STATE:
            with self._cond:
                payload = self._state_bytes()
            meta = json.dumps(self._state_meta()).encode()
            self._reply(conn, P.Header(P.Op.STATE, h.worker, self.shard.index, self.version, self.shard.plan_id,
                                       len(payload) + len(meta), len(meta)), payload, meta)
            return True
        if op == P.Op.SET_STATE:
            blob = torch.empty(h.payload_len, dtype=torch.uint8)
            P.recv_exact_into(conn, memoryview(blob.numpy()))
            try:
                meta = json.loads(blob[self.identity.state_nbytes:].numpy().tobytes())
                self._load_state(blob[:self.identity.state_nbytes], meta)
            except (ValueError, KeyError, TypeError) as exc:
                self._reply_error(conn, f"SET_STATE meta is not valid: {exc}")
                return False
            self._reply(conn, P.Header(P.Op.OK, h.worker, self.shard.index, self.version, self.shard.plan_id))
            return True
        self._reply_error(conn, f"op {op.name} is not handled")  # unreachable: check_request
        return False

    def _params_header(self, worker: int, version: int, aux: int, shm: bool) -> P.Header:
        if shm:
            return P.Header(P.Op.PARAMS, worker, self.shard.index, version, self.shard.plan_id, 0, aux, P.FLAG_SHM)
        return P.Header(P.Op.PARAMS, worker, self.shard.index, version, self.shard.plan_id, self.shard.nbytes, aux)

    def _reply_sender(self, conn: socket.socket, header: P.Header, buffers: "_ConnectionBuffers",
                      snapshot: bool) -> "_ReplySender | _ShmReply":
        if header.flags & P.FLAG_SHM:
            assert buffers.shm_params is not None
            return _ShmReply(conn, P.pack(header), buffers.shm_params)
        return _ReplySender(conn, P.pack(header), snapshot=buffers.send if snapshot else None)

    def _add_to_round(self, grads: list[torch.Tensor], grad_flat: torch.Tensor, borrowed: bool,
                      buffers: "_ConnectionBuffers") -> None:
        """Add a push to the round's gradient sum (lock held). The sum lives in server memory
        and never in a worker's shared region (a worker may read its gradients after step())."""
        if not self._pushed:
            # The round's first gradient buffer becomes the sum: that connection is blocked
            # until the round ends, so its buffer stays put (no copy).
            self._agg_views, self._agg_flat, self._agg_borrowed = grads, grad_flat, borrowed
        elif not grads:
            pass
        elif not self._agg_borrowed:
            torch._foreach_add_(self._agg_views, grads)
        else:
            # The sum so far is a worker's region: move it into this connection's own buffer
            # (blocked until the round ends as well), adding as it goes: no extra pass.
            if borrowed:
                for out, a, g in zip(buffers.recv_views, self._agg_views, grads):
                    torch.add(a, g, out=out)
            else:
                torch._foreach_add_(grads, self._agg_views)
            self._agg_views, self._agg_flat, self._agg_borrowed = buffers.recv_views, buffers.recv, False

    def _push(self, conn: socket.socket, h: P.Header, grads: list[torch.Tensor], grad_flat: torch.Tensor,
              buffers: "_ConnectionBuffers") -> bool:
        w, step = h.worker, h.step
        shm = bool(h.flags & P.FLAG_SHM)
        sender: _ReplySender | _ShmReply | None = None
        with self._cond:
            if not self.state.meta[_META_INITIALISED]:
                self._reply_error_locked(conn, "PUSH before the shard was initialised (INIT first)")
                return False
            if self.mode == "sync":
                expected = self.version
                staleness, depth = 0, self._waiting
                if step == expected - 1:
                    pass  # a resend of the round already applied: just answer it
                elif step != expected or w in self._pushed:
                    self._reply_error_locked(conn, f"PUSH from worker {w} at clock {step} is out of order; "
                                                   f"shard {self.shard.index} is in round {expected}")
                    return False
                else:
                    self._add_to_round(grads, grad_flat, shm, buffers)
                    self._pushed.add(w)
                    if all(o in self._pushed for o in self._active()):
                        # this push completes the round: overlap its update with its reply
                        sender = self._reply_sender(conn, self._params_header(
                            w, self.version + 1, P.join_aux(0, self._waiting), shm), buffers, snapshot=False)
                        self._maybe_finish_sync_round(sender)
                    else:
                        self._waiting += 1
                        self._maybe_finish_sync_round()
                        self._cond.wait_for(lambda: self._stopping or self.version > step)
                        self._waiting -= 1
                        if self.version <= step:
                            return False
                # sync: no update can start until this worker pushes again, so the parameter
                # bytes are stable while we send them: no snapshot copy needed.
                version, payload = self.version, self.state.params
            else:
                clock = self._clock(w)
                if step == clock - 1:
                    staleness = max(0, step - self._min_active_clock())
                elif step != clock:
                    self._reply_error_locked(conn, f"PUSH from worker {w} at clock {step} is out of order; "
                                                   f"its next clock on shard {self.shard.index} is {clock}")
                    return False
                else:
                    staleness = step - self._min_active_clock()
                    if self.mode == "async":
                        # answered at once: overlap the update with the reply; the reply is a
                        # snapshot (buffers.send, or the worker's region written under the
                        # lock), so later updates cannot change it mid-send
                        sender = self._reply_sender(conn, self._params_header(
                            w, self.version + 1, P.join_aux(staleness, self._waiting), shm), buffers, snapshot=True)
                    self._apply(grads, grad_flat, sender)
                    self.state.meta[_META_FIXED + w] = step + 1
                    self._cond.notify_all()
                    if self.mode == "ssp":
                        self._waiting += 1
                        self._cond.wait_for(
                            lambda: self._stopping or self._clock(w) - self._min_active_clock() <= self.staleness)
                        self._waiting -= 1
                depth = self._waiting
                if sender is None:
                    (buffers.shm_params if shm else buffers.send).copy_(self.state.params)
                version, payload = self.version, (None if shm else buffers.send)
        if sender is not None:
            sender.finish()
            return True
        header = self._params_header(w, version, P.join_aux(staleness, depth), shm)
        if shm:
            if payload is self.state.params:  # sync: stable until this worker pushes again
                buffers.shm_params.copy_(payload)
            self._reply(conn, header)
        else:
            self._reply(conn, header, payload)
        return True

    # ------------------------------------------------------------ state transfer

    def _state_bytes(self) -> bytes:
        parts = [self.state.params] + list(self.state.buffers)
        return torch.cat(parts).numpy().tobytes() if parts[0].numel() else b""

    def _state_meta(self) -> dict[str, Any]:
        meta = self.state.meta
        return {"version": int(meta[_META_VERSION]), "token": int(meta[_META_TOKEN]),
                "clocks": [int(meta[_META_FIXED + w]) for w in range(self.num_workers)],
                "steps": [float(x) for x in self.state.steps.tolist()],
                "buffers": list(self.buffer_names)}

    def _load_state(self, blob: torch.Tensor, meta: dict[str, Any]) -> None:
        token = int(meta["token"])
        if list(meta["buffers"]) != list(self.buffer_names):
            raise ValueError(f"state has buffers {meta['buffers']}, this shard's optimizer needs "
                             f"{list(self.buffer_names)}")
        clocks = [int(c) for c in meta["clocks"]]
        if len(clocks) != self.num_workers or len(meta["steps"]) != len(self.shard.segments):
            raise ValueError(f"state is for {len(clocks)} workers and {len(meta['steps'])} segments; "
                             f"this shard has {self.num_workers} and {len(self.shard.segments)}")
        with self._cond:
            if token and token == int(self.state.meta[_META_TOKEN]):
                return  # another worker already restored this same checkpoint
            n = self.shard.nbytes
            self.state.params.copy_(blob[:n])
            for i, buf in enumerate(self.state.buffers):
                buf.copy_(blob[n * (i + 1):n * (i + 2)])
            self.state.steps.copy_(torch.tensor(meta["steps"], dtype=torch.float32))
            self.state.meta[_META_VERSION] = int(meta["version"])
            for w, c in enumerate(clocks):
                self.state.meta[_META_FIXED + w] = c
            self.state.meta[_META_TOKEN] = token
            self.state.meta[_META_INITIALISED] = 1
            self._pushed.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------ replies

    def _reply(self, conn: socket.socket, header: P.Header, *payloads: Any) -> None:
        conn.sendall(P.pack(header))
        for payload in payloads:
            if isinstance(payload, torch.Tensor):
                if payload.numel():
                    conn.sendall(memoryview(payload.numpy()))
            else:
                conn.sendall(payload)

    def _reply_error(self, conn: socket.socket, reason: str) -> None:
        data = reason.encode()
        try:
            self._reply(conn, P.Header(P.Op.ERROR, 0, self.shard.index, 0, self.shard.plan_id, len(data)), data)
        except OSError:
            pass

    def _reply_error_locked(self, conn: socket.socket, reason: str) -> None:
        # Short message on a connection we then close: sending under the lock is harmless.
        self._reply_error(conn, reason)


class _ReplySender:
    """Sends one PARAMS reply from its own thread: the header at once, then each chunk as it
    is ``put`` (copied first into ``snapshot`` at the same offsets when one is given), while
    the caller goes on updating the next chunk."""

    def __init__(self, conn: socket.socket, header: bytes, snapshot: torch.Tensor | None = None) -> None:
        self._conn, self._snapshot, self._offset = conn, snapshot, 0
        self._queue: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, args=(header,), daemon=True)
        self._thread.start()

    def _run(self, header: bytes) -> None:
        try:
            self._conn.sendall(header)
            while (item := self._queue.get()) is not None:
                if item.numel() and self.error is None:
                    self._conn.sendall(memoryview(item.numpy()))
        except OSError as exc:
            self.error = exc
            while self._queue.get() is not None:  # let put() and finish() go on
                pass

    def put(self, chunk: torch.Tensor) -> None:
        """Queue ``chunk`` (the next bytes of the reply) for sending. Does not block."""
        if self._snapshot is not None:
            target = self._snapshot[self._offset:self._offset + chunk.numel()]
            target.copy_(chunk)
            chunk = target
        self._offset += chunk.numel()
        self._queue.put(chunk)

    def finish(self) -> None:
        """Block until every chunk is sent. Raises ``ConnectionError`` if sending failed."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise ConnectionError(f"reply not sent: {self.error}")


class _ShmReply:
    """A PARAMS reply through the worker's shared region: ``put`` copies each updated chunk
    into the worker's parameters at once (under the caller's lock, so it is a consistent
    snapshot); ``finish`` then sends the header, which tells the worker every byte is there."""

    def __init__(self, conn: socket.socket, header: bytes, target: torch.Tensor) -> None:
        self._conn, self._header, self._target, self._offset = conn, header, target, 0

    def put(self, chunk: torch.Tensor) -> None:
        self._target[self._offset:self._offset + chunk.numel()].copy_(chunk)
        self._offset += chunk.numel()

    def finish(self) -> None:
        """Send the header. Raises ``OSError`` if the connection is gone."""
        self._conn.sendall(self._header)


class _ConnectionBuffers:
    """One connection's receive buffer (gradients land here, zero-copy) and send snapshot,
    allocated on first use: a connection that only says HELLO costs nothing."""

    def __init__(self, shard: ShardPlan) -> None:
        self.shard = shard
        self.shm_params: torch.Tensor | None = None   # this shard's bytes of the worker's region
        self.shm_grads: torch.Tensor | None = None
        self.shm_grad_views: list[torch.Tensor] = []

    def attach(self, params: torch.Tensor, grads: torch.Tensor) -> None:
        n = self.shard.nbytes
        self.shm_params, self.shm_grads = params[:n], grads[:n]
        self.shm_grad_views = typed_views(self.shm_grads, self.shard.segments)

    @functools.cached_property
    def recv(self) -> torch.Tensor:
        return torch.empty(self.shard.nbytes, dtype=torch.uint8)

    @functools.cached_property
    def recv_views(self) -> list[torch.Tensor]:
        return typed_views(self.recv, self.shard.segments)

    @functools.cached_property
    def send(self) -> torch.Tensor:
        return torch.empty(self.shard.nbytes, dtype=torch.uint8)


# ---------------------------------------------------------------- the server rank


def _shard_process_main(ready_fd: int) -> None:
    """Child process: read the config (JSON) from stdin, serve one shard on the inherited
    state files until all workers are done, then exit 0."""
    torch.set_num_threads(1)
    config = json.loads(sys.stdin.buffer.read())
    shard = Plan.from_json(config["plan"]).shard(config["index"])
    optimizer = ServerOptimizer(**config["optimizer"])
    files = {name: f"/proc/self/fd/{fd}" for name, fd in config["state_fds"].items()}
    state = ShardState.allocate(shard, buffers_for(optimizer), config["num_workers"], files)
    server = ShardServer(shard, state, num_workers=config["num_workers"], mode=config["mode"],
                         staleness=config["staleness"], optimizer=optimizer, host=config["host"])
    parent = os.getppid()

    def watch_parent() -> None:  # never outlive the supervisor
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch_parent, daemon=True).start()
    os.write(ready_fd, f"{server.host} {server.port} {os.getpid()}\n".encode())
    os.close(ready_fd)
    server.serve_forever()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_shard_supervised(plan_json: str, index: int, *, num_workers: int, mode: str, staleness: int,
                           optimizer: ServerOptimizer, directory: ShardDirectory, host: str,
                           max_restarts: int = 3) -> None:
    """Run shard ``index`` in a child process; restart it on the same state when it dies.

    The child is a fresh interpreter (``python -m torchrelay.train.ps.shard_main``), not a fork
    (this process may hold gloo threads) nor multiprocessing's spawn (which would re-run the
    user's training script). The state lives in unlinked /dev/shm files that both map.
    Blocks until a child exits 0 (every worker sent DONE). Raises ``RuntimeError`` after
    ``max_restarts`` deaths.
    """
    import subprocess
    import tempfile

    shard = Plan.from_json(plan_json).shard(index)
    # The state lives in unlinked files in /dev/shm: this process holds them open and hands
    # the descriptors to each child, so nothing is left behind however either process ends.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fds: dict[str, int] = {}
    for name, (count, dtype) in ShardState.sizes(shard, buffers_for(optimizer), num_workers).items():
        fd, path = tempfile.mkstemp(prefix=f"torchrelay-ps-shard{index}-{name}-", dir=shm)
        os.unlink(path)
        os.ftruncate(fd, count * dtype.itemsize)
        fds[name] = fd
    config = json.dumps({"plan": plan_json, "index": index, "num_workers": num_workers, "mode": mode,
                         "staleness": staleness, "optimizer": optimizer.model_dump(), "host": host,
                         "state_fds": fds}).encode()
    try:
        deaths = 0
        while True:
            read_fd, write_fd = os.pipe()
            child = subprocess.Popen(
                [sys.executable, "-m", "torchrelay.train.ps.shard_main", str(write_fd)],
                pass_fds=(write_fd, *fds.values()), stdin=subprocess.PIPE)
            os.close(write_fd)
            assert child.stdin is not None
            try:
                child.stdin.write(config)
                child.stdin.close()
            except BrokenPipeError:
                pass  # it died at once; wait() below sees it
            with os.fdopen(read_fd) as ready:
                line = ready.readline().split()
            if len(line) == 3:
                directory.publish(index, f"{line[0]}:{line[1]}", int(line[2]))
            try:
                code = child.wait()
            except BaseException:
                child.kill()
                child.wait()
                raise
            if code == 0:
                return
            deaths += 1
            print(f"torchrelay.ps: shard {index} process {child.pid} died (exit code {code}); "
                  f"restart {deaths} of {max_restarts} on its last state", file=sys.stderr, flush=True)
            if deaths > max_restarts:
                raise RuntimeError(f"parameter-server shard {index} died {deaths} times; "
                                   f"giving up after max_restarts={max_restarts}")
    finally:
        for fd in fds.values():
            os.close(fd)

