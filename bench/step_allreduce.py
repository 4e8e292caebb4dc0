"""What a data-parallel step's gradient all-reduce costs here: one model's step, alone and as a pair.

No platform, no cgroups: plain processes on this host, one thread each, the digits CNN
(examples/digits, 71,754 parameters = 287 KB of gradients) or with ``--model charlm`` the char
LM (examples/charlm, its defaults: 2 blocks, d_model 64; ``--batch`` windows of 64 characters),
Adam, ``--batch`` rows per rank drawn from its training set. The same loop runs five ways,
``--steps`` steps each (the first 20 not timed), and the mean step time is printed side by side:

- ``solo``: one process, no process group;
- ``two solos``: two such processes at once (what two cores give without talking);
- ``ddp no_sync``: two ranks under ``DistributedDataParallel`` inside ``no_sync()`` (DDP's own
  bookkeeping, no all-reduce);
- ``ddp``: two ranks under DDP (one bucket, all-reduced on gloo);
- ``all_reduce``: two ranks, the flattened gradients all-reduced by hand after backward.

This is the bound behind ``bench/hetero.py``'s ``vs_sum_solo``: balanced data parallel pays
this all-reduce on every step and a worker training alone does not.

    .venv/bin/python bench/step_allreduce.py [--model digits|charlm] [--batch 64] [--steps 200]

Ends with ``RESULT {"solo_ms", "two_solos_ms", "ddp_no_sync_ms", "ddp_ms", "all_reduce_ms",
"allreduce_cost_ms": ddp − ddp no_sync, "pair_vs_solo": ddp / solo}``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import header_line, package_versions, result_line  # noqa: E402
from _ranks import free_port, run_owned  # noqa: E402

WAYS = {"solo": 1, "two solos": 1, "ddp no_sync": 2, "ddp": 2, "all_reduce": 2}  # way: world size
WARM_UP = 20
CONTEXT = 64  # the char LM's window (its example's default)


def worker(way: str, rank: int, world: int, port: int, out: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    features, labels, model, loss_of = load_model(args.model)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if way.startswith("ddp"):
            model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        index = torch.randint(0, len(features), (args.batch,), generator=generator)
        optimizer.zero_grad()
        with model.no_sync() if way == "ddp no_sync" else contextlib.nullcontext():
            loss = loss_of(model(features[index]), labels[index])
            loss.backward()
        if way == "all_reduce":
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat, [p.grad for p in model.parameters()])
        optimizer.step()
        loss.item()
        if step >= WARM_UP:
            times.append(time.perf_counter() - start)
    Path(out, f"{way}-{rank}.json").write_text(json.dumps(statistics.fmean(times)))
    if world > 1:
        dist.destroy_process_group()


def load_model(name: str):
    """(inputs, targets, model, loss function) of the example ``name``, seeded."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    if name == "digits":
        sys.path.insert(0, str(ROOT / "examples" / "digits"))
        from model import DigitsCNN, load_split

        features, labels = load_split(0)[0].tensors
        return features, labels, DigitsCNN(), F.cross_entropy
    sys.path.insert(0, str(ROOT / "examples" / "charlm"))
    from data import CharCorpus, stdlib_text, text_windows
    from model import CharLM, CharLMConfig, lm_loss

    corpus = CharCorpus.from_text(stdlib_text())
    windows, _ = text_windows(corpus.train, CONTEXT)
    return windows[:, :-1], windows[:, 1:], CharLM(CharLMConfig(vocab_size=corpus.vocab_size, context=CONTEXT)), lm_loss


def run_way(way: str, args: argparse.Namespace, out: str) -> float:
    """Mean step seconds of ``way`` (rank 0's; for two solos the slower of the two)."""
    world, port = WAYS[way], free_port()
    copies = 2 if way == "two solos" else world
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run_owned([[sys.executable, __file__, "--worker", f"{way},{r},{world},{port},{out}", f"--batch={args.batch}",
                f"--steps={args.steps}", f"--model={args.model}"] for r in range(copies)], env)
    return max(json.loads(Path(out, f"{way}-{r}.json").read_text()) for r in range(copies if world == 1 else 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--model", choices=("digits", "charlm"), default="digits")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        way, rank, world, port, out = args.worker.split(",")
        return worker(way, int(rank), int(world), int(port), out, args)
    versions = package_versions(("torch",))
    print(header_line(versions))
    model = "digits CNN" if args.model == "digits" else f"char LM (windows of {CONTEXT} characters)"
    print(f"{model}, {args.batch} rows per rank, {args.steps} steps ({WARM_UP} not timed); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-step-allreduce-") as out:
        ms = {way: run_way(way, args, out) * 1e3 for way in WAYS}
    for way, value in ms.items():
        print(f"{way:<12} {value:7.2f} ms a step  ({value / ms['solo']:.2f} of solo)", flush=True)
    result = {"solo_ms": round(ms["solo"], 2), "two_solos_ms": round(ms["two solos"], 2),
              "ddp_no_sync_ms": round(ms["ddp no_sync"], 2), "ddp_ms": round(ms["ddp"], 2),
              "all_reduce_ms": round(ms["all_reduce"], 2),
              "allreduce_cost_ms": round(ms["ddp"] - ms["ddp no_sync"], 2),
              "pair_vs_solo": round(ms["ddp"] / ms["solo"], 3), "load_average": round(os.getloadavg()[0], 2)}
    print(f"the all-reduce costs {result['allreduce_cost_ms']} ms a step (ddp − ddp no_sync)")
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
