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
