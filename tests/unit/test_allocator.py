"""torchrelay.train.allocator: glibc keeps a step's freed memory instead of re-faulting it."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import resource, statistics
    import torch
    from torchrelay.train.allocator import keep_freed_memory
    applied = keep_freed_memory()
    assert keep_freed_memory() == applied  # idempotent
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)])
    x = torch.randn(64, 512)
    faults = []
    for step in range(12):  # a training loop whose optimizer zeroes with set_to_none
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for chunk in x.chunk(4):
            model(chunk).square().mean().backward()
        model.zero_grad(set_to_none=True)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(applied, int(statistics.median(faults[3:])))
""")



def _probe(env_extra: dict) -> tuple[str, int]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tuned_process_reuses_freed_memory_without_page_faults():
    applied, steady_faults = _probe({})
    assert applied == "True"
    # 6 MiB of gradients are freed and made again every step: untuned glibc re-faults
    # some of them (hundreds of faults a step here), tuned it reuses them
    assert steady_faults < 20


def test_turned_off_by_environment():
    applied, _ = _probe({"RELAY_MALLOC_TUNE": "0"})
    assert applied == "False"


MiB = 1 << 20


@pytest.mark.parametrize("unit_shards, expected", [
    ([], MiB),                                    # no units: the 1 MiB floor
    ([100_000, 3_000], MiB),                      # every unit below 1 MiB (an embedding, a norm)
    ([100_000, 1_579_008, 1_579_008, 60_000], 1_579_008),  # the char LM's blocks on 2 ranks
    ([8 * MiB + 4096] * 16, 8 * MiB + 4096),      # 16 × Linear(2048) on 2 ranks
    ([3 * MiB, 2 * MiB + 1, 5 * MiB], 2 * MiB + 1),  # the smallest unit that counts, not the largest
    ([MiB], MiB),                                 # exactly at the floor
    ([200 * MiB, 64 * MiB], 32 * MiB),            # glibc's maximum
])
def test_shard_threshold_table(unit_shards, expected):
    from torchrelay.train.allocator import shard_threshold_bytes

    assert shard_threshold_bytes(unit_shards) == expected


@pytest.mark.parametrize("bad", [0, -1, 32 * MiB + 1])
def test_threshold_out_of_range_is_refused_with_the_range(bad):
    from torchrelay.train.allocator import return_large_allocations

    with pytest.raises(ValueError, match=rf"mmap threshold {bad} bytes: glibc takes 1 to 33554432 bytes"):
        return_large_allocations(bad)


MOVE_PROBE = textwrap.dedent("""
    import ctypes
    import torch
    from torchrelay.train.allocator import return_large_allocations, returned_threshold_bytes

    class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def mmapped_by(mib):  # bytes glibc mmaps for one live tensor of ``mib`` MiB
        before = libc.mallinfo2().hblkhd
        kept = torch.empty(mib << 18)
        grown = libc.mallinfo2().hblkhd - before
        del kept
        return grown

    took = return_large_allocations()
    first = (returned_threshold_bytes(), mmapped_by(2))
    assert return_large_allocations() == took  # idempotent
    moved = return_large_allocations(3 << 20)
    print(took, moved, *first, returned_threshold_bytes(), mmapped_by(2), mmapped_by(4))
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_threshold_moves_and_buffers_below_it_come_from_the_heap():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RELAY_MALLOC_TUNE", None)
    out = subprocess.run([sys.executable, "-c", MOVE_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    took, moved, first_threshold, first_mmapped, threshold, mmapped_2, mmapped_4 = out
    assert (took, moved) == ("True", "True")
    assert (int(first_threshold), int(threshold)) == (MiB, 3 * MiB)
    assert int(first_mmapped) >= 2 * MiB  # above 1 MiB: its own mapping, returned when freed
    assert int(mmapped_2) == 0            # below 3 MiB: from the heap, reused
    assert int(mmapped_4) >= 4 * MiB      # above it: mapped still


def test_turned_off_threshold_sets_nothing():
    probe = ("from torchrelay.train.allocator import return_large_allocations as r, returned_threshold_bytes as t\n"
             "print(r(), r(3 << 20), t())")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "RELAY_MALLOC_TUNE": "0"},
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    assert out == ["False", "False", "None"]
