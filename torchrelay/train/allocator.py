"""Keep glibc's malloc from handing a training step's memory back to the kernel every step.

Contract: ``keep_freed_memory()`` raises glibc's trim threshold (never shrink the heap) and
fixes its mmap threshold at glibc's maximum, 32 MiB on 64-bit (tensors up to that size come
from the heap, and are reused, instead of a fresh ``mmap`` each time). Process-wide;
idempotent; returns True when both settings took, False where the C library is not glibc,
glibc refused one of them, or ``RELAY_MALLOC_TUNE=0``. Never raises.

Why: a CPU training step frees and reallocates the same tensors every step (activations,
and gradients when the optimizer zeroes them with ``set_to_none=True``, torch's default).
With glibc's defaults the freed top of the heap is trimmed and megabyte-sized tensors are
``mmap``ed afresh, so the next step touches new pages: measured here, 1,000–3,000 page faults
per step on each stage of a 2-stage MLP pipeline, ≈ 2 ms of its 33 ms step
(docs/pipeline.md, "Page faults"). The cost is memory: the heap stays at its peak, which a
training process reaches every step anyway. PyTorch's answer is to preload jemalloc or
tcmalloc (``torch.backends.xeon.run_cpu``), which a job cannot assume is installed;
``mallopt`` is glibc's own switch for the same thing, and the environment variables it
reads at start-up (``MALLOC_TRIM_THRESHOLD_``) come too late for a process already running.

``return_large_allocations(threshold_bytes=1 MiB)`` is the opposite choice, for sharded training
(``fsdp``), where memory is the point: it fixes the mmap threshold, so every buffer at or above it
(FSDP's gathered units, its reduce-scatter buffers, freed whole-model tensors after sharding) is
``mmap``ed and goes back to the kernel when freed. ``prepare`` sets 1 MiB before it shards, then
``shard_threshold_bytes`` of the units it made: the smallest per-rank shard of a unit that is at
least 1 MiB, at most glibc's 32 MiB. With glibc's default *dynamic* threshold the
first freed 16 MiB buffer raises the threshold above it, later ones come from the heap, and the
heap fragments: measured here, 16 × Linear(2048, 2048) with Adam on 2 fsdp ranks grew to
2,052 MiB resident per rank over three steps, and stayed at 894 MiB with the fixed threshold.
The price is step time: buffers above the threshold are faulted in afresh every step (at 1 MiB
the char LM's fsdp step was 1.27–1.35 of a ddp job's against 1.12–1.19 under glibc's defaults;
on a faster CPU 1.83, and 1.56 with the shards' 1.5 MiB); ``bench/allocator.py``
weighs each threshold's step time against its resident memory (docs/strategies.md): the heap
stays unfragmented while the threshold is no larger than a unit's shard, and every buffer below it
(activations, the optimizer's temporaries) is reused instead of faulted in, hence a threshold
derived from the shards. Process-wide; the last call's threshold holds; True when it took,
``RELAY_MALLOC_TUNE=0`` turns it off (every call then returns False and sets nothing).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
# glibc's largest allowed mmap threshold: 4 MiB × sizeof(long), 32 MiB on 64-bit
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long)
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: ≈ never trim

RETURNED_MMAP_THRESHOLD_BYTES = 1 << 20

_applied: bool | None = None
_returning: tuple[int, bool] | None = None  # (threshold, took)


def _mallopt():  # noqa: ANN202 - the C function, or None where the C library is not glibc
    if os.environ.get("RELAY_MALLOC_TUNE", "1") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its mallopt numbers differ
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def keep_freed_memory() -> bool:
    """Tune glibc malloc for a training process (see module docstring). Idempotent."""
    global _applied
    if _applied is not None:
        return _applied
    mallopt = _mallopt()
    _applied = mallopt is not None and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) \
        and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return _applied


def shard_threshold_bytes(unit_shard_bytes: list[int]) -> int:
    """The mmap threshold for sharded training whose units hold ``unit_shard_bytes`` on this rank:
    the smallest of them that is at least ``RETURNED_MMAP_THRESHOLD_BYTES`` (units below it, such
    as an embedding or a norm, leave no mark), clamped to glibc's maximum; that floor when none
    is. Pure."""
    large = [size for size in unit_shard_bytes if size >= RETURNED_MMAP_THRESHOLD_BYTES]
    return min(min(large, default=RETURNED_MMAP_THRESHOLD_BYTES), MMAP_THRESHOLD_BYTES)


def return_large_allocations(threshold_bytes: int | None = None) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` (default ``RETURNED_MMAP_THRESHOLD_BYTES``,
    1 MiB) for sharded training (see module docstring). Idempotent for the same threshold; a later
    call with another moves it. Raises ValueError outside 1 byte .. glibc's 32 MiB."""
    global _returning
    threshold = RETURNED_MMAP_THRESHOLD_BYTES if threshold_bytes is None else threshold_bytes
    if not 0 < threshold <= MMAP_THRESHOLD_BYTES:
        raise ValueError(f"mmap threshold {threshold} bytes: glibc takes 1 to {MMAP_THRESHOLD_BYTES} bytes")
    if _returning is None or _returning[0] != threshold:
        mallopt = _mallopt()
        _returning = (threshold, mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold)))
    return _returning[1]


def returned_threshold_bytes() -> int | None:
    """The threshold ``return_large_allocations`` last set, or None when it set none. Pure read."""
    return _returning[0] if _returning is not None and _returning[1] else None
