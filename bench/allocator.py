"""glibc's mmap threshold under ``fsdp``: what each setting costs a step and what it saves in resident memory.

On CPU workers ``fsdp``'s ``prepare`` fixes glibc's mmap threshold
(``torchrelay/train/allocator.py``): buffers above it are ``mmap``ed and go back to the kernel
when freed, which keeps a sharded job's resident memory down, and every step then faults
those pages in afresh. This bench weighs the two, side by side in one run, for each setting:

- ``glibc``: glibc's defaults, a dynamic threshold (``RELAY_MALLOC_TUNE=0``);
- ``1``, ``2``, ``4``, ``8``: a fixed threshold of that many MiB (``1`` is what ``fsdp`` shipped
  before the threshold followed the shards);
- ``shards``: what ``fsdp`` ships: 1 MiB while sharding, then the smallest unit's shard of at
  least 1 MiB (the char LM on 2 ranks: 1.5 MiB; 16 × Linear(2048): 8 MiB; 64 × Linear(1024): 2 MiB);
- ``ddp``: a ``ddp`` job as it ships (glibc's defaults), the baseline.

Each (setting, model) is its own launch of 2 gloo ranks, because the threshold is process-wide
and glibc's dynamic threshold cannot be restored in a process once it has been fixed. The bench
fixes a threshold by replacing ``allocator.RETURNED_MMAP_THRESHOLD_BYTES`` and
``allocator.shard_threshold_bytes`` in each worker before ``prepare`` calls them; there is no
user-facing knob beyond ``RELAY_MALLOC_TUNE``.

- **Step**: the char LM of bench/sharded.py (4 blocks of d_model 256, 16 windows of 64
  characters per rank), median of ``--steps`` steps after one untimed step; ``--rounds`` launches
  per setting, the settings' order rotated each round (the machine's phases last seconds to
  minutes), and the median of the rounds' medians. Minor page faults per step come with it.
- **Memory**: 16 × Linear(2048) (8 MiB shards on 2 ranks) and 64 × Linear(1024) (2 MiB shards),
  Adam, 32 rows, 5 steps: each rank's peak resident memory (``ru_maxrss``), the larger of the two ranks.

    .venv/bin/python bench/allocator.py [--rounds 3] [--steps 20]

Prints the rows, then ``RESULT {"step_vs_ddp_<setting>", "rss_mib_<model>_<setting>", ...}``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402
from _ranks import free_port, run_owned  # noqa: E402

SETTINGS = ("glibc", "1", "2", "4", "8", "shards", "ddp")
MEMORY_MODELS = {"linear2048x16": (2048, 16), "linear1024x64": (1024, 64)}


def rotated(items: tuple[str, ...], round_: int) -> list[str]:
    """``items`` rotated by ``round_`` places: each round starts with a different setting."""
    shift = round_ % len(items)
    return [*items[shift:], *items[:shift]]


def apply_setting(setting: str) -> None:
    """Before torchrelay's ``prepare``: the allocator ``setting`` names (see the module docstring)."""
    if setting in ("glibc", "ddp"):
        os.environ["RELAY_MALLOC_TUNE"] = "0"
        return
    if setting == "shards":  # as fsdp ships
        return
    from torchrelay.train import allocator

    fixed = int(float(setting) * 2**20)
    allocator.RETURNED_MMAP_THRESHOLD_BYTES = fixed
    allocator.shard_threshold_bytes = lambda _unit_shard_bytes: fixed


def worker(part: str, setting: str, rank: int, port: int, out: str, steps: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    apply_setting(setting)
    import torch
    from torch import nn

    import torchrelay.train as rt
    from sharded import batch_and_loss, build, timed_step
    from torchrelay.spec import DDPStrategy, FSDPStrategy
    from torchrelay.train import sharded, sync

    torch.set_num_threads(1)
    ctx = rt.init()
    if part == "step":
        args = argparse.Namespace(model="charlm", layers=4, width=256, batch=16)
        model = build(args)
        rows, loss_of = batch_and_loss(args, rank)
    else:
        width, layers = MEMORY_MODELS[part]
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        rows = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
        loss_of = lambda m, x: m(x).square().mean()  # noqa: E731
        steps = 5
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if setting == "ddp":
        model, optimizer = sync.prepare(model, optimizer, DDPStrategy(), ctx)
    else:
        model, optimizer = sharded.prepare(model, optimizer, FSDPStrategy(kind="fsdp"), ctx)
    timed_step(model, optimizer, rows, loss_of)  # untimed: FSDP's lazy init, first allocations
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = [timed_step(model, optimizer, rows, loss_of) for _ in range(steps)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    from torchrelay.train import allocator

    threshold = allocator.returned_threshold_bytes()
    Path(out, f"rank-{rank}.json").write_text(json.dumps(
        {"step_s": statistics.median(times), "faults_per_step": faults / steps, "peak_rss_mib": peak_rss_mib,
         "threshold_mib": None if threshold is None else round(threshold / 2**20, 3)}))
    rt.shutdown()


def launch(part: str, setting: str, steps: int) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-allocator-") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        env.pop("RELAY_MALLOC_TUNE", None)  # each setting sets its own
        run_owned([[sys.executable, __file__, "--worker", f"{part},{setting},{r},{port},{out}", f"--steps={steps}"]
                   for r in range(2)], env)
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        part, setting, rank, port, out = args.worker.split(",")
        return worker(part, setting, int(rank), int(port), out, args.steps)
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions))
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    result: dict = {}
    for part in MEMORY_MODELS:
        for setting in SETTINGS:
            ranks = launch(part, setting, args.steps)
            peak = max(r["peak_rss_mib"] for r in ranks)
            result[f"rss_mib_{part}_{setting}"] = round(peak)
            if setting == "shards":
                result[f"threshold_mib_{part}"] = ranks[0]["threshold_mib"]
            print(f"memory {part:<14} {setting:>6}: peak resident {peak:7.0f} MiB per rank "
                  f"(threshold {ranks[0]['threshold_mib']} MiB)", flush=True)
    medians: dict[str, list[float]] = {s: [] for s in SETTINGS}
    faults: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for round_ in range(args.rounds):
        for setting in rotated(SETTINGS, round_):
            rank0 = launch("step", setting, args.steps)[0]
            if setting == "shards":
                result["threshold_mib_charlm"] = rank0["threshold_mib"]
            medians[setting].append(rank0["step_s"])
            faults[setting].append(rank0["faults_per_step"])
            print(f"step round {round_} {setting:>6}: {rank0['step_s'] * 1e3:7.0f} ms, "
                  f"{rank0['faults_per_step']:8.0f} page faults per step", flush=True)
    ddp = statistics.median(medians["ddp"])
    for setting in SETTINGS:
        step = statistics.median(medians[setting])
        result[f"step_ms_{setting}"] = round(step * 1e3, 1)
        result[f"step_vs_ddp_{setting}"] = round(step / ddp, 4)
        result[f"faults_per_step_{setting}"] = round(statistics.median(faults[setting]))
        rss = "  ".join(f"{part} {result[f'rss_mib_{part}_{setting}']:5d} MiB" for part in MEMORY_MODELS)
        print(f"{setting:>6}: char LM step {step * 1e3:7.0f} ms ({step / ddp:.3f} of ddp)   peak resident: {rss}")
    result["load_average"] = round(os.getloadavg()[0], 2)
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
