"""Checkpoint save throughput against a raw fsync'd write of the same bytes, and async blocking.

One process, a real model state of ``--mb`` MB (default 210: an MLP of 2560×2560 layers), in a
scratch folder on the disk the store uses (default: a temp folder under the repo's disk).

Throughput (each round in turn, ``--rounds`` rounds, medians; ``os.sync()`` before each so no
write-back of an earlier one is billed to the next):
- raw: every tensor's bytes written one after another into one file, 8 MiB writes, then fsync
  (what ``dd bs=8M conv=fsync`` does, from the tensors' own memory);
- dd: ``dd if=/dev/zero bs=8M conv=fsync`` of the same size, for reference;
- ours: ``CheckpointStore.save`` (DCP plan, parallel raw writes hashed as they go, fsync,
  .metadata, manifest, ``latest``): everything a committed checkpoint costs;
- torch.save + fsync and DCP's stock ``FileSystemWriter`` (one thread): the baselines the issue names.

Async: a training loop (SGD on the MLP, batch 16) saves at one step synchronously and, in
another run of the same loop, asynchronously (``rt.save_checkpoint(async_=True)``). Blocked
time = the save call + the time the next optimizer step / forward waited for the staging copy.

Ends with ``RESULT {"save_vs_raw_write": raw_s / ours_s (medians), "async_block_ratio": blocked_async_s /
sync_save_s, ...}``; ``save_vs_raw_write_best_rounds`` compares the fastest round of each, which
on a shared disk is often the fairer figure.

    OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint.py [--mb 210] [--rounds 3] [--dir PATH]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402

CHUNK = 8 << 20
WIDTH = 2560


def make_model(mb: int) -> torch.nn.Module:
    layers = max(1, round(mb * 1e6 / (WIDTH * (WIDTH + 1) * 4)))
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks[:-1])


def state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fresh(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.sync()


def raw_write(state: dict, folder: Path) -> float:
    fresh(folder)
    start = time.perf_counter()
    with open(folder / "raw.bin", "wb") as fh:
        for tensor in state.values():
            view = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            for offset in range(0, len(view), CHUNK):
                fh.write(view[offset:offset + CHUNK])
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start


def dd_write(nbytes: int, folder: Path) -> float | None:
    if shutil.which("dd") is None:
        return None
    fresh(folder)
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={folder / 'dd.bin'}", "bs=8M", f"count={nbytes // CHUNK + 1}",
                    "conv=fsync"], check=True, capture_output=True)
    return time.perf_counter() - start


def torch_save(state: dict, folder: Path) -> float:
    fresh(folder)
    start = time.perf_counter()
    with open(folder / "state.pt", "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start


def stock_dcp(state: dict, folder: Path) -> float:
    import torch.distributed.checkpoint as dcp

    fresh(folder)
    start = time.perf_counter()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder), thread_count=1), no_dist=True)
    return time.perf_counter() - start


def ours(state: dict, folder: Path, step: int) -> float:
    from torchrelay.storage import ArtifactStore
    from torchrelay.train.checkpoint import CheckpointStore

    fresh(folder)
    checkpoints = CheckpointStore(ArtifactStore(str(folder)), "bench", keep=1)
    start = time.perf_counter()
    checkpoints.save({"model": state}, step)
    return time.perf_counter() - start


def sha256_time(state: dict) -> float:
    """Seconds to sha256 every tensor's bytes in two threads (what the checksums cost by themselves)."""
    import hashlib
    import threading

    views = [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in state.values()]

    def run(part: list[memoryview]) -> None:
        for view in part:
            hasher = hashlib.sha256()
            for offset in range(0, len(view), CHUNK):
                hasher.update(view[offset:offset + CHUNK])

    threads = [threading.Thread(target=run, args=(views[i::2],)) for i in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def training_run(model: torch.nn.Module, *, async_: bool, saves: int, first_at: int = 4) -> list[dict]:
    """A training loop that saves ``saves`` times; per save, how long the loop was held up by it.

    The first save is at step ``first_at``; each next one at the first step after the previous
    one committed (a checkpoint interval longer than a save, as in a real job), so the "at most
    one in flight" wait is not what is measured.
    """
    import torchrelay.train as rt
    from torchrelay.train import checkpoint as ckpt

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    waited = [0.0]
    real_wait = ckpt.wait_for_staging

    def timed_wait() -> None:  # the guard hooks call this by name: time what they block
        start = time.perf_counter()
        real_wait()
        waited[0] += time.perf_counter() - start

    ckpt.wait_for_staging = timed_wait
    x, y = torch.randn(16, WIDTH), torch.randn(16, WIDTH)
    plain_steps, records = [], []
    step = 0
    try:
        while len(records) < saves or "next_step_s" not in records[-1]:
            step += 1
            start = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            elapsed = time.perf_counter() - start
            if records and "next_step_s" not in records[-1]:
                records[-1].update(guard_wait_s=waited[0], blocked_s=records[-1]["call_s"] + waited[0],
                                   next_step_s=elapsed)  # the step after a save is where the guard waits
            else:
                plain_steps.append(elapsed)
            in_flight = ckpt.save_in_progress()
            if step >= first_at and len(records) < saves and not in_flight:
                os.sync()  # neither mode pays for write-back it did not cause
                waited[0] = 0.0
                start = time.perf_counter()
                rt.save_checkpoint({"model": model.state_dict()}, step, async_=async_, guard=[model, optimizer])
                records.append({"call_s": time.perf_counter() - start})
        rt.wait_for_checkpoint()
    finally:
        ckpt.wait_for_staging = real_wait
    for record in records:
        record["plain_step_s"] = statistics.median(plain_steps)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=210)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="scratch folder (default: a temp folder next to the repo)")
    args = parser.parse_args()
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=REPO.parent))
    os.environ["RELAY_OUTPUT_DIR"] = str(scratch / "job")
    for name in ("RELAY_STORE_URL", "RELAY_JOB_ID", "RELAY_CHECKPOINT", "WORLD_SIZE", "RANK"):
        os.environ.pop(name, None)
    model = make_model(args.mb)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = state_bytes(state)
    print(f"state: {len(state)} tensors, {nbytes / 1e6:.0f} MB; scratch {scratch}; "
          f"torch {torch.__version__}, {os.cpu_count()} cpus (shared machine: figures are noisy)")
    times: dict[str, list[float]] = {"raw": [], "dd": [], "ours": [], "torch.save": [], "dcp stock (1 thread)": []}
    try:
        for round_ in range(args.rounds):
            times["raw"].append(raw_write(state, scratch / "raw"))
            dd = dd_write(nbytes, scratch / "dd")
            if dd is not None:
                times["dd"].append(dd)
            times["ours"].append(ours(state, scratch / "ours", round_ + 1))
            times["torch.save"].append(torch_save(state, scratch / "torch"))
            times["dcp stock (1 thread)"].append(stock_dcp(state, scratch / "dcp"))
        for folder in ("raw", "dd", "ours", "torch", "dcp"):
            shutil.rmtree(scratch / folder, ignore_errors=True)
        raw_s = statistics.median(times["raw"])
        print(f"\n{'save of ' + str(round(nbytes / 1e6)) + ' MB':<24}{'median s':>10}{'GB/s':>8}{'vs raw':>8}   rounds")
        for name, values in times.items():
            if values:
                median = statistics.median(values)
                print(f"{name:<24}{median:>10.3f}{nbytes / median / 1e9:>8.2f}{raw_s / median:>8.2f}   "
                      + " ".join(f"{v:.3f}" for v in values))
        save_vs_raw = raw_s / statistics.median(times["ours"])
        best_vs_raw = min(times["raw"]) / min(times["ours"])  # least disturbed round of each
        print(f"ours / raw: {save_vs_raw:.2f} (medians), {best_vs_raw:.2f} (best rounds)")
        hash_s = sha256_time(state)
        print(f"(sha256 of the same bytes, 2 threads, no I/O: {hash_s:.3f} s; the raw write computes no checksum,"
              f" a committed checkpoint needs one per file)")

        # two saves each: the first async save of a process also starts its two threads
        sync_saves = training_run(model, async_=False, saves=2)
        os.sync()
        async_saves = training_run(model, async_=True, saves=2)
        print(f"\n{'training loop':<24}{'blocked s':>10}{'call s':>9}{'guard s':>9}{'plain step s':>14}"
              f"{'next step s':>13}")
        for name, runs in (("sync save", sync_saves), ("async save", async_saves)):
            for n, run in enumerate(runs, 1):
                print(f"{name + f' #{n}':<24}{run['blocked_s']:>10.4f}{run['call_s']:>9.4f}"
                      f"{run['guard_wait_s']:>9.4f}{run['plain_step_s']:>14.3f}{run['next_step_s']:>13.3f}")
        print("(blocked = the save call + what the next forward/step waited for the staging copy; async: the"
              " next steps share the cores with the copy and the writes, 'next step s' shows that cost)")
        sync_s = statistics.median(r["blocked_s"] for r in sync_saves)
        block_ratio = async_saves[-1]["blocked_s"] / sync_s  # steady state: the second async save
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {"save_vs_raw_write": round(save_vs_raw, 3), "async_block_ratio": round(block_ratio, 4),
              "save_vs_raw_write_best_rounds": round(best_vs_raw, 3),
              "state_mb": round(nbytes / 1e6), "raw_write_gb_s": round(nbytes / raw_s / 1e9, 2)}
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
