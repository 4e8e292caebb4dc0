"""Shared-memory transport between neighbour pipeline stages on one host.

Why hand-written: gloo's send/recv between two processes on one host goes through TCP
loopback and gloo's own threads; on a 2-core machine with one compute process per core those
threads and their wake-ups wait for a core, costing ~0.3 ms per micro-batch per rank
(bench/pipeline.py). torch has no same-host point-to-point channel for CPU tensors outside
``torch.multiprocessing`` (which needs a parent that spawned both processes). Here a step's
activations and gradients live in a file in ``/dev/shm`` mapped by both neighbours
(``torch.from_file(shared=True)``) and a one-byte message on a Unix socket (abstract
namespace, so no file) says "the next slot is ready": one memcpy and one ``send`` to send, one
``recv`` (which drains every ready signal at once) to receive, and no extra threads. A socket
rather than a pipe: when a neighbour dies its end closes and the reader fails at once.

Contract:
- ``connect_neighbours`` is collective over the default process group (every rank calls it
  once per ``prepare``) and returns, for this rank, a ``NeighbourChannel`` to the previous
  and to the next stage when that neighbour runs on this host, else None (gloo is used).
  Neighbours count as on this host when both see the same host id, can connect to each
  other's socket and see each other's files in the shared-memory folder (containers on one
  host may not share it); otherwise that pair uses gloo. Buffer files are unlinked as soon
  as both ends have mapped them, so a crash leaves nothing behind.
- Messages on one channel direction are read in the order they were written; the runtime
  sends a step's header, then one signal per micro-batch in micro-batch order.
- A read raises ``RuntimeError`` naming the peer rank when the peer's end closes (it exited)
  or nothing arrives for ``timeout_s`` (default: 30 min, like gloo's).
"""
from __future__ import annotations

import os
import secrets
import select
import socket
import tempfile

import torch
import torch.distributed as dist

_ALIGN = 64


def _shm_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class SlotRegion:
    """Activation and gradient slots of one input shape, in one file both neighbours map."""

    def __init__(self, path: str, layout: list[tuple[tuple[int, ...], torch.dtype]]):
        offsets, total = [], 0
        for shape, dtype in layout * 2:  # activations, then their gradients
            offsets.append(total)
            nbytes = max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            total += -(-nbytes // _ALIGN) * _ALIGN
        raw = torch.from_file(path, shared=True, size=max(total, _ALIGN), dtype=torch.uint8)
        storage = raw.untyped_storage()
        views = []
        for (shape, dtype), off in zip(layout * 2, offsets):
            # Each slot is its own tensor on the shared storage, not a view of ``raw``: views
            # share one autograd version counter, so writing a gradient slot would look like
            # an in-place change of the activation slots autograd saved.
            size = torch.empty((), dtype=dtype).element_size()
            views.append(torch.empty(0, dtype=dtype).set_(storage, off // size, shape))
        self.acts, self.grads = views[:len(layout)], views[len(layout):]


class NeighbourChannel:
    """Signals (a Unix socket) and shared slots between this rank and a neighbour on this host."""

    def __init__(self, peer: int, sock: socket.socket, prefix: str, lower: bool,
                 timeout_s: float):
        self.peer, self.sock, self.prefix, self.lower = peer, sock, prefix, lower
        self.timeout_ms = int(timeout_s * 1000)
        self.regions: dict[tuple, SlotRegion] = {}
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def write(self, data: bytes) -> None:
        """Send ``data`` (tiny messages, read every step: does not block for long)."""
        self.sock.sendall(data)

    def read_some(self, max_bytes: int) -> bytes:
        """At least one and at most ``max_bytes`` bytes; blocks until some arrive."""
        if not self._poll.poll(self.timeout_ms):
            raise RuntimeError(f"pipeline: nothing from rank {self.peer} for "
                               f"{self.timeout_ms / 1000:.0f} s; is it still running?")
        data = self.sock.recv(max_bytes)
        if not data:
            raise RuntimeError(f"pipeline: rank {self.peer} closed its channel (did it exit?)")
        return data

    def read_exact(self, n: int) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self.read_some(n - got)
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def open_region(self, key: tuple, layout: list[tuple[tuple[int, ...], torch.dtype]]
                    ) -> SlotRegion:
        """Map the slots for ``key`` on both sides. Both neighbours call it at the same point
        of the same step (the end of the first step of a new shape); blocks until both have."""
        path = f"{self.prefix}-{len(self.regions)}.buf"
        if self.lower:
            region = SlotRegion(path, layout)
            self.write(b"R")
            if self.read_exact(1) != b"A":
                raise RuntimeError(f"pipeline: bad handshake from rank {self.peer}")
            os.unlink(path)
        else:
            if self.read_exact(1) != b"R":
                raise RuntimeError(f"pipeline: bad handshake from rank {self.peer}")
            region = SlotRegion(path, layout)
            self.write(b"A")
        self.regions[key] = region
        return region

    def close(self) -> None:
        self.sock.close()


def connect_neighbours(prev_rank: int | None, next_rank: int | None, enabled: bool = True,
                       timeout_s: float = 1800.0
                       ) -> tuple[NeighbourChannel | None, NeighbourChannel | None]:
    """Channels to the previous and next stage where they share this host. Collective over
    the default group (every rank calls it, with its own neighbours); blocks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = (_host_id(), secrets.token_hex(6), bool(enabled))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    token = everyone[0][1]
    folder = _shm_dir()

    def candidate(peer):
        return peer is not None and everyone[peer][2] and enabled and everyone[peer][0] == mine[0]

    def pair_name(low, high):
        return f"torchrelay-pp-{token}-{low}-{high}"

    # The lower rank of a pair listens and leaves a probe file; the upper one connects and
    # looks for the file. Both must work for the pair to use shared memory.
    listener = probe = None
    if candidate(next_rank):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind("\0" + pair_name(rank, next_rank))
        listener.listen(1)
        probe = os.path.join(folder, pair_name(rank, next_rank) + ".probe")
        open(probe, "wb").close()
    dist.barrier()
    upper_sock, upper_ok = None, False
    if candidate(prev_rank):
        upper_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            upper_sock.connect("\0" + pair_name(prev_rank, rank))
            upper_ok = os.path.exists(os.path.join(folder, pair_name(prev_rank, rank) + ".probe"))
        except OSError:
            upper_ok = False
    oks = [None] * world
    dist.all_gather_object(oks, upper_ok)
    prev_channel = next_channel = None
    if upper_sock is not None:
        if upper_ok:
            prev_channel = NeighbourChannel(prev_rank, upper_sock,
                                            os.path.join(folder, pair_name(prev_rank, rank)),
                                            lower=False, timeout_s=timeout_s)
        else:
            upper_sock.close()
    if listener is not None:
        if oks[next_rank]:
            conn, _ = listener.accept()  # already queued: the peer connected before the gather
            next_channel = NeighbourChannel(next_rank, conn,
                                            os.path.join(folder, pair_name(rank, next_rank)),
                                            lower=True, timeout_s=timeout_s)
        listener.close()
        os.unlink(probe)
    return prev_channel, next_channel
