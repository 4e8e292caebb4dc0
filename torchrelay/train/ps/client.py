"""The worker side: a model whose parameters live in one flat buffer, and an optimizer-shaped
object whose ``step()`` pushes gradients to every shard and pulls fresh parameters back.

Contract:
- ``FlatModel(model)`` re-points every parameter (``p.data``) and its ``.grad`` at typed views
  of two contiguous byte buffers laid out by ``plan.make_plan``; a pull lands directly in the
  parameters with ``recv_into`` (no copy), a push sends the gradients straight from theirs.
  On a non-CPU model the buffers are CPU staging copies (one copy each way per step).
  Where ``shm.shm_enabled()``, both buffers live in one sealed memfd (``shm.WorkerRegion``)
  that a shard on the same host maps: then a push and its pull move no bytes on the socket
  (only the 48-byte headers), the server reading the gradients and writing the parameters
  in place. A shard elsewhere, or one that declines, is spoken to over TCP as before.
- ``PSOptimizer.step()`` pushes this worker's gradient for its clock to all shards in
  parallel (one thread per shard) and blocks until every shard answers with parameters —
  at once in ``async``, after the round in ``sync``, within the staleness bound in ``ssp``.
  A shard whose connection breaks is looked up again in the store (its supervisor publishes
  a new generation on restart) and the push is resent; the server drops duplicates.
  Raises ``ProtocolError`` if a server refuses a message, ``TimeoutError`` if a shard stays
  unreachable for ``reconnect_timeout_s``.
- ``zero_grad()`` zeroes the gradient buffer (the views stay in place whatever
  ``set_to_none`` says). ``metrics()`` returns and resets the figures since the last call,
  with the ``memory_*`` peaks every data-parallel strategy reports (``train.memory_meter``):
  this worker's parameters and gradients (the flat buffers' views; on a GPU worker its CPU
  staging copies too), optimizer state 0 (the servers hold it), and activations.
- ``state_dict()`` gathers every shard's parameters, optimizer buffers and clocks into
  full tensors keyed by parameter name (independent of how many servers there are);
  ``load_state_dict(sd)`` scatters it back. Call it on every worker: the servers apply a
  given checkpoint once, the other calls only align the caller's clock and parameters.
- ``close()`` tells every shard this worker is done (giving up on a shard after 5 s, with a
  line on stderr). Idempotent; also run at exit.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import json
import random
import socket
import sys
import threading
import time
from typing import Any

import torch

from torchrelay.train.memory import MemoryFigures
from torchrelay.train.memory_meter import MemoryMeter
from torchrelay.train.prepared import StrategyOptimizer
from torchrelay.train.ps import protocol as P
from torchrelay.train.ps.plan import ITEMSIZE, ParamSpec, Plan, make_plan
from torchrelay.train.ps.rendezvous import ShardDirectory
from torchrelay.train.ps.server import buffers_for
from torchrelay.train.ps.shm import WorkerRegion, same_host, shm_enabled


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the servers keep: those that require grad (frozen ones stay local)."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def layout_of(model: torch.nn.Module) -> list[ParamSpec]:
    out = []
    for name, p in trainable(model):
        dtype = str(p.dtype).removeprefix("torch.")
        if dtype not in ITEMSIZE:
            raise ValueError(f"parameter {name!r} has dtype {p.dtype}; the parameter server "
                             f"supports {', '.join(ITEMSIZE)}")
        out.append(ParamSpec(name, dtype, tuple(p.shape)))
    return out


class FlatModel:
    """The model's parameters and gradients as views of two flat byte buffers."""

    def __init__(self, model: torch.nn.Module, plan: Plan) -> None:
        self.model = model
        self.params = [p for _, p in trainable(model)]
        self.device = self.params[0].device
        self.on_cpu = self.device.type == "cpu"
        self.region: WorkerRegion | None = None
        if shm_enabled():
            try:
                self.region = WorkerRegion.create(plan.total_nbytes)
            except OSError as exc:  # e.g. a sandbox without memfd sealing: TCP only
                print(f"torchrelay.ps: shared memory unavailable, using TCP only: {exc}", file=sys.stderr)
        if self.region is not None:
            self.param_flat, self.grad_flat = self.region.params, self.region.grads
        else:
            self.param_flat = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
            self.grad_flat = torch.zeros(plan.total_nbytes, dtype=torch.uint8)
        self.param_views, self.grad_views = [], []
        for spec, offset, p in zip(plan.params, plan.offsets, self.params):
            dtype = getattr(torch, spec.dtype)
            pv = self.param_flat[offset:offset + spec.nbytes].view(dtype).view(spec.shape)
            gv = self.grad_flat[offset:offset + spec.nbytes].view(dtype).view(spec.shape)
            with torch.no_grad():
                pv.copy_(p.detach())
            self.param_views.append(pv)
            self.grad_views.append(gv)
            if self.on_cpu:
                p.data = pv
                p.grad = gv

    def gather_grads(self) -> None:
        """Make ``grad_flat`` hold the current gradients (a no-op when they already live there)."""
        for p, gv in zip(self.params, self.grad_views):
            g = p.grad
            if g is None:
                gv.zero_()
                if self.on_cpu:
                    p.grad = gv
            elif g.data_ptr() != gv.data_ptr():
                gv.copy_(g)
                if self.on_cpu:
                    p.grad = gv

    def scatter_params(self) -> None:
        """After a pull: make the model's parameters equal ``param_flat``."""
        if not self.on_cpu:
            with torch.no_grad():
                for p, pv in zip(self.params, self.param_views):
                    p.copy_(pv, non_blocking=False)


class _ShardLink:
    """One worker's connection to one shard, reconnecting through the directory."""

    def __init__(self, index: int, directory: ShardDirectory, reconnect_timeout_s: float,
                 region: WorkerRegion | None = None, attach: P.Header | None = None) -> None:
        self.index, self.directory, self.reconnect_timeout_s = index, directory, reconnect_timeout_s
        self.generation = 0
        self.sock: socket.socket | None = None
        self.reconnects = 0
        self.pid = 0
        self.region, self._attach = region, attach
        self.shm = False                       # this connection moves payloads through the region
        self.shm_declined: str | None = None   # why the shard would not map it, if it would not

    def connect(self, newer_than: int = 0) -> None:
        """Connect to the newest incarnation after ``newer_than``; offer the shared region
        when the shard is on this host (every incarnation maps it anew)."""
        generation, host, port, pid = self.directory.lookup(self.index, newer_than, self.reconnect_timeout_s)
        self.close()
        self.sock = socket.create_connection((host, port), timeout=self.reconnect_timeout_s)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.generation, self.pid = generation, pid
        if self.region is not None and self._attach is not None and same_host(self.sock):
            reply, reason = self._exchange(self._attach, [self.region.attach_payload()], None)
            self.shm = reply.aux == 1
            self.shm_declined = None if self.shm else reason.decode(errors="replace")

    def _reconnect(self) -> None:
        """Try the incarnation we knew (the connection alone may have broken); if it
        refuses, wait for the supervisor to publish a newer one."""
        self.reconnects += 1
        try:
            self.connect(max(0, self.generation - 1))
        except OSError:
            self.connect(self.generation)

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
                self.shm = False

    def request(self, header: P.Header, payloads: list[Any], reply_into: memoryview | None = None,
                hello: P.Header | None = None) -> tuple[P.Header, bytes]:
        """Send one request and read its reply, reconnecting (and re-saying ``hello``) on a
        broken connection until ``reconnect_timeout_s`` passes. A PARAMS reply lands in
        ``reply_into``. Raises ``ProtocolError`` on an ERROR reply."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                if self.sock is None:
                    self._reconnect()
                    if hello is not None:
                        self._exchange(hello, [], None)
                return self._exchange(header, payloads, reply_into)
            except (ConnectionError, OSError) as exc:
                self.close()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"parameter-server shard {self.index} unreachable for "
                                       f"{self.reconnect_timeout_s:.0f}s: {exc}") from exc
                # loop: _reconnect() blocks in lookup() until the supervisor publishes a
                # newer generation of this shard than the one that broke

    def _exchange(self, header: P.Header, payloads: list[Any], reply_into: memoryview | None) -> tuple[P.Header, bytes]:
        assert self.sock is not None
        shm = self.shm and reply_into is not None and header.op in (P.Op.PUSH, P.Op.PULL)
        if shm:  # the server reads the gradient from, and writes the parameters into, the region
            header, payloads = dataclasses.replace(header, flags=P.FLAG_SHM, payload_len=0), []
        self.sock.sendall(P.pack(header))
        for payload in payloads:
            if len(payload):
                self.sock.sendall(payload)
        reply = P.recv_header(self.sock)
        if reply.op == P.Op.ERROR:
            reason = P.recv_bytes(self.sock, reply.payload_len).decode(errors="replace")
            self.close()
            raise P.ProtocolError(f"parameter-server shard {self.index} refused {header.op.name}: {reason}")
        if reply_into is not None:
            want_len, want_flags = (0, P.FLAG_SHM) if shm else (len(reply_into), 0)
            if reply.op != P.Op.PARAMS or reply.payload_len != want_len or reply.flags != want_flags:
                self.close()
                raise P.ProtocolError(f"shard {self.index} answered {header.op.name} with {reply.op.name} "
                                      f"of {reply.payload_len} bytes, flags {reply.flags:#x}; expected "
                                      f"PARAMS of {want_len} bytes, flags {want_flags:#x}")
            if not shm:
                P.recv_exact_into(self.sock, reply_into)
            return reply, b""
        return reply, P.recv_bytes(self.sock, reply.payload_len)


class PSOptimizer(StrategyOptimizer):
    """What ``prepare`` returns as the optimizer in parameter-server mode. See module docstring."""

    def __init__(self, model: torch.nn.Module, *, rank: int, num_workers: int, servers: int,
                 mode: str, optimizer_config: Any, directory: ShardDirectory, user_optimizer: Any = None,
                 reconnect_timeout_s: float = 120.0) -> None:
        self.rank, self.num_workers, self.mode = rank, num_workers, mode
        self.user_optimizer = user_optimizer
        self.param_groups = user_optimizer.param_groups if user_optimizer is not None else []
        self.buffer_names = buffers_for(optimizer_config)
        plan = make_plan(layout_of(model), servers)
        if rank == 0:
            directory.publish_plan(plan.to_json())
        else:
            published = Plan.from_json(directory.read_plan())
            if published.plan_id != plan.plan_id:
                raise ValueError(f"worker {rank}'s model layout differs from worker 0's "
                                 f"({len(plan.params)} vs {len(published.params)} parameters, "
                                 f"{plan.total_nbytes} vs {published.total_nbytes} bytes); every "
                                 "worker must build the same model")
        self.plan = plan
        self.shards = [plan.shard(i) for i in range(servers)]
        self.flat = FlatModel(model, plan)
        staging = 0 if self.flat.on_cpu else plan.total_nbytes  # CPU copies of a GPU model's tensors
        self.meter = MemoryMeter(model, None, staging=MemoryFigures(parameters=staging, gradients=staging))
        region = self.flat.region
        self.links = [_ShardLink(i, directory, reconnect_timeout_s, region,
                                 self._header(P.Op.ATTACH, i, payload_len=P.ATTACH.size)) for i in range(servers)]
        self._pool = (concurrent.futures.ThreadPoolExecutor(servers, thread_name_prefix="ps-link")
                      if servers > 1 else None)
        self.clock = 0
        self._closed = False
        self._lock = threading.Lock()
        self._reset_metrics()
        for link in self.links:
            link.connect()
        replies = self._each(lambda i: self.links[i].request(self._hello(i), []))
        self.clock = replies[0][0].step if mode == "sync" else min(r[0].step for r in replies)
        if rank == 0:
            self._each(lambda i: self.links[i].request(
                self._header(P.Op.INIT, i, payload_len=self.shards[i].nbytes), [self._param_bytes(i)]))
        self.pull()
        atexit.register(self.close)

    # ------------------------------------------------------------ helpers

    def _header(self, op: P.Op, shard: int, step: int = 0, payload_len: int = 0, aux: int = 0) -> P.Header:
        return P.Header(op, self.rank, shard, step, self.plan.plan_id, payload_len, aux)

    def _hello(self, shard: int) -> P.Header:
        return self._header(P.Op.HELLO, shard, self.clock, aux=self.num_workers)

    def _param_bytes(self, shard: int) -> memoryview:
        s = self.shards[shard]
        return memoryview(self.flat.param_flat[s.begin:s.end].numpy())

    def _grad_bytes(self, shard: int) -> memoryview:
        s = self.shards[shard]
        return memoryview(self.flat.grad_flat[s.begin:s.end].numpy())

    def _each(self, fn: Any) -> list[Any]:
        if self._pool is None:
            return [fn(0)]
        return list(self._pool.map(fn, range(len(self.links))))

    def _reset_metrics(self) -> None:
        self._bytes_pushed = self._bytes_pulled = 0
        self._net_s = 0.0
        self._staleness: list[int] = []
        self._queue_depths: list[int] = []

    # ------------------------------------------------------------ the optimizer surface

    def pull(self) -> int:
        """Fetch the current parameters from every shard into the model. Returns the
        smallest shard version seen."""
        replies = self._each(lambda i: self.links[i].request(
            self._header(P.Op.PULL, i), [], self._param_bytes(i), hello=self._hello(i)))
        self.flat.scatter_params()
        self._bytes_pulled += self.plan.total_nbytes
        return min(r[0].step for r in replies)

    def step(self, closure: Any = None) -> Any:
        """Push this worker's gradients, wait for the servers, pull the new parameters.

        Blocks as the mode says (see module docstring). Returns ``closure()``'s loss if given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.flat.gather_grads()
        clock = self.clock
        started = time.perf_counter()
        replies = self._each(lambda i: self.links[i].request(
            self._header(P.Op.PUSH, i, clock, self.shards[i].nbytes), [self._grad_bytes(i)],
            self._param_bytes(i), hello=self._hello(i)))
        self._net_s += time.perf_counter() - started
        self.flat.scatter_params()
        self.clock = clock + 1
        staleness = [P.split_aux(r[0].aux) for r in replies]
        self._staleness.append(max(s for s, _ in staleness))
        self._queue_depths.append(max(d for _, d in staleness))
        self._bytes_pushed += self.plan.total_nbytes
        self._bytes_pulled += self.plan.total_nbytes
        self.last_version = min(r[0].step for r in replies)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient. The gradient views stay in place whatever ``set_to_none`` says."""
        self.flat.grad_flat.zero_()
        if self.flat.on_cpu:
            for p, gv in zip(self.flat.params, self.flat.grad_views):
                p.grad = gv
        else:
            for p in self.flat.params:
                p.grad = None

    def metrics(self) -> dict[str, float]:
        """Figures since the previous call: push/pull bytes per second of network time, the
        staleness the servers observed (max and mean per step), server queue depth; and the
        ``memory_*`` peaks so far (see the module docstring)."""
        net = self._net_s or float("nan")
        out = {
            "ps_push_bytes_per_s": self._bytes_pushed / net if self._staleness else 0.0,
            "ps_pull_bytes_per_s": self._bytes_pulled / net if self._staleness else 0.0,
            "ps_staleness_max": float(max(self._staleness, default=0)),
            "ps_staleness_mean": (sum(self._staleness) / len(self._staleness)) if self._staleness else 0.0,
            "ps_server_queue_depth": (sum(self._queue_depths) / len(self._queue_depths)) if self._queue_depths else 0.0,
            "ps_reconnects": float(sum(link.reconnects for link in self.links)),
            "ps_shm_shards": float(sum(link.shm for link in self.links)),
            "ps_steps": float(len(self._staleness)),
            **self.meter.metrics(),
        }
        self._reset_metrics()
        return out

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything the servers hold, as full tensors by parameter name. One round trip per shard."""
        n_bufs = len(self.buffer_names)
        flats = [torch.zeros(self.plan.total_nbytes, dtype=torch.uint8) for _ in range(1 + n_bufs)]
        steps: dict[int, float] = {}
        metas = []

        def fetch(i: int) -> None:
            reply, payload = self.links[i].request(self._header(P.Op.GET_STATE, i), [], hello=self._hello(i))
            meta = json.loads(payload[len(payload) - reply.aux:])
            blob = torch.frombuffer(bytearray(payload[:len(payload) - reply.aux]), dtype=torch.uint8) \
                if len(payload) > reply.aux else torch.zeros(0, dtype=torch.uint8)
            s = self.shards[i]
            for k, flat in enumerate(flats):
                flat[s.begin:s.end].copy_(blob[k * s.nbytes:(k + 1) * s.nbytes])
            for seg, count in zip(s.segments, meta["steps"]):
                steps[seg.param] = count
            metas.append(meta)

        self._each(fetch)
        names = [p.name for p in self.plan.params]

        def tensors(flat: torch.Tensor) -> dict[str, torch.Tensor]:
            return {spec.name: flat[off:off + spec.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape).clone()
                    for spec, off in zip(self.plan.params, self.plan.offsets)}

        return {
            "format": "torchrelay.ps/1",
            "mode": self.mode,
            "version": min(m["version"] for m in metas),
            "clocks": [min(m["clocks"][w] for m in metas) for w in range(self.num_workers)],
            "params": tensors(flats[0]),
            "buffers": {name: tensors(flats[1 + k]) for k, name in enumerate(self.buffer_names)},
            "steps": {names[i]: steps.get(i, 0.0) for i in range(len(names))},
            "token": random.getrandbits(62) + 1,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the servers from ``state_dict()``'s output and pull. Raises ``ValueError``
        naming a missing or mis-shaped entry."""
        if state.get("format") != "torchrelay.ps/1":
            raise ValueError(f"not a parameter-server state (format={state.get('format')!r}); "
                             "expected one made by PSOptimizer.state_dict()")
        if list(state["buffers"]) != list(self.buffer_names):
            raise ValueError(f"state has optimizer buffers {list(state['buffers'])}; the server "
                             f"optimizer in this job needs {list(self.buffer_names)}")
        if len(state["clocks"]) != self.num_workers:
            raise ValueError(f"state is for {len(state['clocks'])} workers; this job has {self.num_workers}")
        flats = [torch.zeros(self.plan.total_nbytes, dtype=torch.uint8) for _ in range(1 + len(self.buffer_names))]
        sources = [state["params"]] + [state["buffers"][n] for n in self.buffer_names]
        for flat, source in zip(flats, sources):
            for spec, off in zip(self.plan.params, self.plan.offsets):
                if spec.name not in source:
                    raise ValueError(f"state has no entry for parameter {spec.name!r}")
                value = source[spec.name]
                if tuple(value.shape) != spec.shape or str(value.dtype).removeprefix("torch.") != spec.dtype:
                    raise ValueError(f"state entry {spec.name!r} is {tuple(value.shape)} {value.dtype}; "
                                     f"the model has {spec.shape} {spec.dtype}")
                flat[off:off + spec.nbytes].view(value.dtype).view(spec.shape).copy_(value)
        names = [p.name for p in self.plan.params]

        def send(i: int) -> None:
            s = self.shards[i]
            meta = json.dumps({"version": int(state["version"]), "token": int(state["token"]),
                               "clocks": [int(c) for c in state["clocks"]],
                               "steps": [float(state["steps"][names[seg.param]]) for seg in s.segments],
                               "buffers": list(self.buffer_names)}).encode()
            parts = [memoryview(f[s.begin:s.end].numpy()) for f in flats]
            self.links[i].request(self._header(P.Op.SET_STATE, i, payload_len=s.nbytes * len(flats) + len(meta),
                                               aux=len(meta)), parts + [meta], hello=self._hello(i))

        self._each(send)
        self.clock = int(state["clocks"][self.rank]) if self.mode != "sync" else int(state["version"])
        self.pull()

    def close(self) -> None:
        """Tell every shard this worker is done, then disconnect. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.meter.close()
        try:  # sequential: at interpreter exit the thread pool no longer takes work
            for i, link in enumerate(self.links):
                # a worker exiting because the job is going down must not hang here
                link.reconnect_timeout_s = min(link.reconnect_timeout_s, 5.0)
                try:
                    link.request(self._header(P.Op.DONE, i), [], hello=self._hello(i))
                except (OSError, P.ProtocolError) as exc:
                    print(f"torchrelay.ps: could not tell shard {i} that worker {self.rank} is done: {exc}",
                          file=sys.stderr, flush=True)
        finally:
            for link in self.links:
                link.close()
            if self.flat.region is not None:
                self.flat.region.close()
            if self._pool is not None:
                self._pool.shutdown(wait=False)
