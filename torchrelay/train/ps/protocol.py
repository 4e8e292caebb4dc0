"""The parameter server's wire format: a fixed versioned header, then raw tensor bytes.

Why a socket protocol and not ``torch.distributed`` point-to-point (measured, docs/design.md,
reference figures, and ``bench/ps.py``): on loopback both move a 100 MB push+pull at about the same rate
(~2.6 GB/s here), so speed does not decide it. What decides it: a gloo process group dies as a
whole when one member dies, so a crashed server shard could never be restarted and
reconnected to; a socket can. A header we own also lets a server check every message (version,
layout hash, length, sequence) before a byte of it touches a parameter, and ``recv_into`` lets
the payload land straight in preallocated tensors (no copy on receive). TensorPipe RPC is not
used (unmaintained, and about half the loopback rate here).

Message = ``HEADER`` (48 bytes, little endian) + ``payload_len`` bytes:

    magic "TRPS" | version u8 | op u8 | flags u16 | worker u32 | shard u32 |
    step u64 | plan_id u64 | payload_len u64 | aux u64

Shared memory on one host (``FLAG_SHM``, version 2). Why: on loopback every byte of a TCP
push+pull is copied four times (send and receive, each way) and that copying is the whole
cost; NCCL and TensorPipe's shm/cma paths avoid it on one host the same way. A worker on the
server's host keeps its parameters and gradients in a sealed memfd (it can neither shrink
nor grow, so the server never faults on a mapping cut short) and offers it with ``ATTACH``
(pid, fd, size, offsets, a random nonce the region starts with). The server maps it only if
the connection's two ends share an address, the file is sealed, its size and offsets fit
and the nonce matches; otherwise it declines (``OK`` with aux 0 and the reason as payload)
and the connection stays plain TCP. On an attached connection a ``PUSH``/``PULL`` with
``FLAG_SHM`` carries no payload: the server reads the gradient from, and writes the new
parameters into, the worker's region, and answers ``PARAMS`` with ``FLAG_SHM`` and no payload
once every byte is written. Headers still travel on the socket and are checked exactly as
before; the worker is blocked in ``step()`` while its region is in use. Chosen by measurement
(``bench/ps.py`` (a), same run, 2 loaded cores): 100 MB push+pull at 1.5-2.2x raw loopback
TCP through the region, 0.6-0.9x over the socket.

Contract:
- ``pack`` / ``unpack`` are exact inverses for every valid header; ``unpack`` raises
  ``ProtocolError`` for a short buffer, a wrong magic or version, an unknown op, an unknown
  flag bit, or ``FLAG_SHM`` on an op other than PUSH / PULL / PARAMS.
- ``check_request`` (pure) says why a request cannot be served by a given shard, or None
  (``FLAG_SHM`` only on a connection that attached a region, and then with no payload).
  A server calls it before reading any payload; a rejected message is answered with
  ``ERROR`` and the connection is closed, parameters untouched.
- ``recv_exact_into`` fills a writable buffer from a socket or raises ``ConnectionError``.
"""
from __future__ import annotations

import dataclasses
import enum
import socket
import struct

from torchrelay.errors import RelayError

MAGIC = b"TRPS"
VERSION = 2
HEADER = struct.Struct("<4sBBHIIQQQQ")
HEADER_SIZE = HEADER.size  # 48
MAX_STATE_META = 1 << 20   # JSON trailer of a SET_STATE message
FLAG_SHM = 0x1             # payload in the connection's shared-memory region, not on the socket
KNOWN_FLAGS = FLAG_SHM
# ATTACH payload: pid, fd, file size, params offset, grads offset, nonce (16 bytes)
ATTACH = struct.Struct("<QQQQQ16s")


class ProtocolError(RelayError):
    """A message on the parameter-server wire broke the protocol; names what and why."""


class Op(enum.IntEnum):
    # worker -> server
    HELLO = 1       # step: worker's next clock; aux: number of workers
    INIT = 2        # payload: the shard's initial parameters (first INIT wins)
    PUSH = 3        # step: the push's clock; payload: the shard's gradient
    PULL = 4        # reply PARAMS once initialised
    DONE = 5        # the worker has finished training
    GET_STATE = 6   # reply STATE
    SET_STATE = 7   # payload: state buffers + JSON meta (aux = JSON length)
    ATTACH = 8      # payload: ATTACH; reply OK, aux 1 = attached, 0 = declined (payload: why)
    # server -> worker
    OK = 64         # step: server version; aux: 1 if initialised
    PARAMS = 65     # step: server version; aux: staleness | queue_depth << 32; payload: params
    STATE = 66      # payload: state buffers + JSON meta (aux = JSON length)
    ERROR = 67      # payload: utf-8 reason


WORKER_OPS = frozenset({Op.HELLO, Op.INIT, Op.PUSH, Op.PULL, Op.DONE, Op.GET_STATE, Op.SET_STATE, Op.ATTACH})
SHM_OPS = frozenset({Op.PUSH, Op.PULL, Op.PARAMS})


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    op: Op
    worker: int = 0
    shard: int = 0
    step: int = 0
    plan_id: int = 0
    payload_len: int = 0
    aux: int = 0
    flags: int = 0


def pack(header: Header) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(header.op), header.flags, header.worker, header.shard,
                       header.step, header.plan_id, header.payload_len, header.aux)


def unpack(data: bytes | bytearray | memoryview) -> Header:
    """Decode a header. Raises ``ProtocolError`` naming the bad field and value."""
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"header is {len(data)} bytes; expected {HEADER_SIZE}")
    magic, version, op, flags, worker, shard, step, plan_id, length, aux = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported; expected {VERSION}")
    try:
        op = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown op {op}; expected one of {[int(o) for o in Op]}") from None
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(f"flags={flags:#x} has bits unknown to protocol version {VERSION}; "
                            f"known: {KNOWN_FLAGS:#x}")
    if flags & FLAG_SHM and op not in SHM_OPS:
        raise ProtocolError(f"flags={flags:#x} (shared memory) on {op.name}; only "
                            f"{', '.join(o.name for o in sorted(SHM_OPS))} may carry it")
    return Header(op, worker, shard, step, plan_id, length, aux, flags)


@dataclasses.dataclass(frozen=True, slots=True)
class ShardIdentity:
    """What a server knows to check a request against."""

    shard: int
    plan_id: int
    num_workers: int
    shard_nbytes: int
    state_nbytes: int


def check_request(header: Header, me: ShardIdentity, shm_attached: bool = False) -> str | None:
    """Why ``header`` cannot be served by shard ``me`` (None when it can); ``shm_attached``
    says whether the connection it came on has a shared-memory region. Pure."""
    if header.op not in WORKER_OPS:
        return f"op {header.op.name} is not a request a worker may send"
    if header.flags & FLAG_SHM and not shm_attached:
        return (f"flags={header.flags:#x} (shared memory) on a connection with no shared memory "
                "attached; ATTACH first or send the payload on the socket")
    if header.shard != me.shard:
        return f"message for shard {header.shard} reached shard {me.shard}"
    if header.plan_id != me.plan_id:
        return (f"plan_id {header.plan_id:#x} does not match this shard's {me.plan_id:#x}: "
                "the worker's model layout (names, dtypes, shapes) differs from the servers'")
    if header.worker >= me.num_workers:
        return f"worker {header.worker} is out of range; this job has {me.num_workers} workers"
    expected = {Op.INIT: me.shard_nbytes, Op.PUSH: me.shard_nbytes, Op.ATTACH: ATTACH.size}.get(header.op)
    if header.flags & FLAG_SHM:
        expected = 0  # the payload is in the shared region
    if header.op == Op.SET_STATE:
        if not 0 < header.aux <= MAX_STATE_META:
            return f"SET_STATE meta length {header.aux} is outside 1..{MAX_STATE_META}"
        expected = me.state_nbytes + header.aux
    if expected is None:
        expected = 0
    if header.payload_len != expected:
        return (f"{header.op.name} carries {header.payload_len} payload bytes; "
                f"shard {me.shard} expects exactly {expected}")
    if header.op == Op.HELLO and header.aux != me.num_workers:
        return f"worker says the job has {header.aux} workers; this shard serves {me.num_workers}"
    return None


def recv_exact_into(sock: socket.socket, buffer: memoryview) -> None:
    """Fill ``buffer`` (writable, byte-shaped) from ``sock``. Raises ``ConnectionError`` on EOF."""
    view = buffer.cast("B") if buffer.format != "B" else buffer
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {total} bytes")
        got += n


def recv_header(sock: socket.socket) -> Header:
    """Read and decode one header. Raises ``ConnectionError`` or ``ProtocolError``."""
    raw = bytearray(HEADER_SIZE)
    recv_exact_into(sock, memoryview(raw))
    return unpack(raw)


def recv_bytes(sock: socket.socket, length: int) -> bytes:
    raw = bytearray(length)
    recv_exact_into(sock, memoryview(raw))
    return bytes(raw)


def pack_attach(pid: int, fd: int, size: int, params_offset: int, grads_offset: int, nonce: bytes) -> bytes:
    return ATTACH.pack(pid, fd, size, params_offset, grads_offset, nonce)


def unpack_attach(data: bytes) -> tuple[int, int, int, int, int, bytes]:
    """ATTACH payload -> (pid, fd, size, params_offset, grads_offset, nonce). Raises
    ``ProtocolError`` for a payload of the wrong size."""
    if len(data) != ATTACH.size:
        raise ProtocolError(f"ATTACH payload is {len(data)} bytes; expected {ATTACH.size}")
    return ATTACH.unpack(data)


def split_aux(aux: int) -> tuple[int, int]:
    """PARAMS aux -> (staleness, queue_depth)."""
    return aux & 0xFFFFFFFF, aux >> 32


def join_aux(staleness: int, queue_depth: int) -> int:
    return min(staleness, 0xFFFFFFFF) | (min(queue_depth, 0xFFFFFFFF) << 32)
