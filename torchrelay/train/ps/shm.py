"""Shared memory between a worker and a shard on the same host (see ``protocol`` for the why).

Contract:
- ``shm_enabled()`` — whether this process may offer shared memory: Linux ``memfd_create``
  with sealing exists and ``RELAY_PS_SHM`` is not ``0`` (set it to force plain TCP).
- ``WorkerRegion.create(nbytes)`` (worker) — one sealed memfd laid out as
  ``[nonce page | params | grads]``; ``.params`` / ``.grads`` are uint8 tensors of ``nbytes``
  each, mapped shared, zeroed. ``.attach_payload()`` is the ATTACH message body naming it.
  The fd stays open for the region's life (the server opens it through /proc/<pid>/fd).
- ``map_worker_region(payload, params_end)`` (server) — validate and map what a worker offered;
  returns ``(params, grads)``, uint8 tensors of the worker's whole flat buffers, sharing its
  memory. Raises ``ShmDeclined`` naming why (unreadable fd, not sealed against shrinking and
  growing, size or offsets that do not fit ``params_end`` bytes, wrong nonce). Never maps a
  file it has not checked: the checks and the mapping use the same open file.
- ``same_host(sock)`` — whether a connected TCP socket's two ends have the same address,
  the condition both sides check before offering or accepting shared memory.
"""
from __future__ import annotations

import fcntl
import os
import secrets
import socket

import torch

from torchrelay.train.ps import protocol as P

NONCE_BYTES = 16
PAGE = 4096
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW if hasattr(fcntl, "F_SEAL_SHRINK") else 0


class ShmDeclined(Exception):
    """The server will not map what the worker offered; the connection stays plain TCP."""


def shm_enabled() -> bool:
    return (hasattr(os, "memfd_create") and bool(_REQUIRED_SEALS)
            and os.environ.get("RELAY_PS_SHM", "1") != "0")


def same_host(sock: socket.socket) -> bool:
    try:
        return sock.getpeername()[0] == sock.getsockname()[0]
    except OSError:
        return False


def _round_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class WorkerRegion:
    """A worker's parameters and gradients in one sealed, shareable memfd."""

    def __init__(self, fd: int, size: int, params_offset: int, grads_offset: int, nbytes: int,
                 nonce: bytes, whole: torch.Tensor) -> None:
        self.fd, self.size, self.nonce = fd, size, nonce
        self.params_offset, self.grads_offset = params_offset, grads_offset
        self.params = whole[params_offset:params_offset + nbytes]
        self.grads = whole[grads_offset:grads_offset + nbytes]
        self._whole = whole

    @classmethod
    def create(cls, nbytes: int) -> "WorkerRegion":
        """Raises ``OSError`` when the memfd cannot be made or sealed (caller falls back to TCP)."""
        params_offset = PAGE
        grads_offset = params_offset + _round_up(nbytes)
        size = grads_offset + _round_up(nbytes)
        fd = os.memfd_create("torchrelay-ps-worker", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            whole = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8)
        except BaseException:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(NONCE_BYTES)
        whole[:NONCE_BYTES].copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
        return cls(fd, size, params_offset, grads_offset, nbytes, nonce, whole)

    def attach_payload(self) -> bytes:
        return P.pack_attach(os.getpid(), self.fd, self.size, self.params_offset, self.grads_offset, self.nonce)

    def close(self) -> None:
        """Close the fd (the mapping lives on while tensors view it). Idempotent."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_worker_region(payload: bytes, params_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate the ATTACH ``payload`` and map the worker's region (see module docstring)."""
    try:
        pid, fd, size, params_offset, grads_offset, nonce = P.unpack_attach(payload)
    except P.ProtocolError as exc:
        raise ShmDeclined(str(exc)) from None
    if not (params_offset >= NONCE_BYTES and grads_offset >= NONCE_BYTES
            and max(params_offset, grads_offset) + params_end <= size
            and (params_offset + params_end <= grads_offset or grads_offset + params_end <= params_offset)):
        raise ShmDeclined(f"offsets {params_offset}/{grads_offset} of {params_end} bytes each do not fit "
                          f"apart in a region of {size} bytes after the nonce")
    try:
        ours = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise ShmDeclined(f"cannot open fd {fd} of process {pid}: {exc.strerror}") from None
    try:
        actual = os.fstat(ours).st_size
        if actual != size:
            raise ShmDeclined(f"the region is {actual} bytes; the worker said {size}")
        try:
            seals = fcntl.fcntl(ours, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
            raise ShmDeclined(f"the region is not sealed against shrinking and growing (seals {seals:#x})")
        whole = torch.from_file(f"/proc/self/fd/{ours}", shared=True, size=size, dtype=torch.uint8)
    finally:
        os.close(ours)
    if bytes(whole[:NONCE_BYTES].numpy()) != nonce:
        raise ShmDeclined("the region's nonce differs from the ATTACH message (another process's file?)")
    return whole[params_offset:params_offset + params_end], whole[grads_offset:grads_offset + params_end]
