"""Sharded data parallel: memory per rank and step time of ``fsdp`` against ``ddp`` and against FSDP2 by hand.

One launch per world size (2, then 4 gloo ranks on this host, one thread each) builds the same
model four times, from the same seed, and prepares it four ways:

- ``ddp``: ``torchrelay.train.sync.prepare`` under ``{kind: ddp}`` (what ``rt.prepare`` runs);
- ``fsdp``: ``torchrelay.train.sharded.prepare`` under ``{kind: fsdp}`` (what ``rt.prepare`` runs);
- ``hand``: the model wrapped as PyTorch's FSDP2 tutorial does it — ``fully_shard`` on each
  block, then on the model, and ``torch.optim.Adam(model.parameters())`` — no torchrelay;
- ``keep``: ``{kind: fsdp, reshard_after_forward: false}``: each unit stays gathered from its
  forward to its backward (one all-gather per unit a step instead of two). Step time only: it
  holds every unit whole at the end of forward, which the memory meter's one-unit allowance
  does not count.

The model: ``--layers`` blocks of Linear(d, d) + GELU (d = ``--width``), Adam, ``--batch`` rows
per rank; or, with ``--model charlm``, the char LM of examples/charlm with ``--layers`` blocks
of d_model ``--width`` (4 heads), ``--batch`` windows of 64 random characters per rank (its
units: the embedding, each block, the head). The linear stack does little compute per byte of
parameters, the char LM a transformer's share: the step ratio is about how much compute a
step has to hide FSDP's extra collectives behind. Memory per rank is parameters + gradients
+ optimizer state as ``train.memory_meter`` reads them after a step (this rank's shards, plus
the largest unit gathered whole under fsdp; DDP's gradient buckets are not counted, which
favours ddp). Step time: forward, backward and optimizer step, after one untimed step of
each; then ``--rounds`` × ``--steps`` cycles of one step of each way in turn (the order rotated
every cycle), so that the machine's slower and faster phases fall on every way alike; median per
way on rank 0. Where ours and the tutorial differ: ours keeps the last block gathered after
forward (backward needs it at once; torchtitan does the same), the tutorial reshards it and
gathers it again.

    .venv/bin/python bench/sharded.py [--layers 16] [--width 512] [--rounds 5] [--steps 10]
    .venv/bin/python bench/sharded.py --model charlm --layers 4 --width 256 --batch 16   # or --batch 8

Prints the rows, then ``RESULT {"fsdp2_memory_vs_ddp", "fsdp4_memory_vs_ddp", "fsdp_step_vs_ddp",
"fsdp_vs_hand_written", ...}``: memory and step ratios are ours over ddp's (lower is better;
goals ≤ 0.6, ≤ 0.35 and ≤ 1.3); ``fsdp_vs_hand_written`` is the hand-written step time over
ours (our speed relative to it; goal ≥ 0.97); ``keep_step_vs_ddp`` is ``keep``'s step over
ddp's. The step ratios are from the 2-rank launch.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402
from _ranks import free_port, run_owned  # noqa: E402

WAYS = ("ddp", "fsdp", "hand", "keep")


CONTEXT, VOCAB = 64, 96  # the char LM's window and a vocabulary the size of its example's


def charlm_module():
    """examples/charlm/model.py (CharLM, CharLMConfig, lm_loss)."""
    import importlib

    if str(ROOT / "examples" / "charlm") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples" / "charlm"))
    return importlib.import_module("model")


def build(args: argparse.Namespace):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if args.model == "charlm":
        charlm = charlm_module()
        config = charlm.CharLMConfig(vocab_size=VOCAB, context=CONTEXT, d_model=args.width, n_heads=4,
                                     n_layers=args.layers)
        return charlm.CharLM(config)
    return nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU()) for _ in range(args.layers)])


def batch_and_loss(args: argparse.Namespace, rank: int):
    """(this rank's fixed batch, loss of (model, batch)) for ``--model``."""
    import torch

    generator = torch.Generator().manual_seed(rank)
    if args.model == "charlm":
        lm_loss = charlm_module().lm_loss
        ids = torch.randint(VOCAB, (args.batch, CONTEXT + 1), generator=generator)
        return ids, lambda model, rows: lm_loss(model(rows[:, :-1]), rows[:, 1:])
    return torch.randn(args.batch, args.width, generator=generator), lambda model, rows: model(rows).square().mean()


def prepared(way: str, args: argparse.Namespace, ctx):
    import torch

    from torchrelay.spec import DDPStrategy, FSDPStrategy
    from torchrelay.train import sharded, sync
    from torchrelay.train.memory_meter import MemoryMeter

    model = build(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    if way == "ddp":
        model, optimizer = sync.prepare(model, optimizer, DDPStrategy(), ctx)
        return model, optimizer, optimizer.meter
    if way in ("fsdp", "keep"):
        strategy = FSDPStrategy(kind="fsdp", reshard_after_forward=way == "fsdp")
        model, optimizer = sharded.prepare(model, optimizer, strategy, ctx)
        return model, optimizer, optimizer.meter
    from torch.distributed.fsdp import fully_shard  # the tutorial's way

    for block in model:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    gathered = sharded.fsdp.largest_unit_bytes(model, [str(i) for i in range(len(model))])  # as ours counts it
    return model, optimizer, MemoryMeter(model, optimizer, gathered_bytes=gathered)


def timed_step(model, optimizer, batch, loss_of) -> float:
    """Seconds of one forward, backward and optimizer step, after a barrier (so no rank waits inside it)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss_of(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def interleaved_order(cycle: int) -> list[str]:
    """The ways in the order cycle ``cycle`` runs them: rotated by one each cycle, so no way always
    follows the same other (whose freed memory and cold caches it would inherit)."""
    shift = cycle % len(WAYS)
    return [*WAYS[shift:], *WAYS[:shift]]


def worker(rank: int, world: int, port: int, out: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch

    import torchrelay.train as rt

    torch.set_num_threads(1)
    ctx = rt.init()
    batch, loss_of = batch_and_loss(args, rank)
    runs = {way: prepared(way, args, ctx) for way in WAYS}
    for way, (model, optimizer, _meter) in runs.items():
        timed_step(model, optimizer, batch, loss_of)  # warm-up, untimed: FSDP's lazy init, first allocations
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    # One step of each way in turn, not a block of steps per way: the machine's slower and faster
    # phases (seconds long on these shared cores) then fall on every way alike.
    for cycle in range(args.rounds * args.steps):
        for way in interleaved_order(cycle):
            model, optimizer, _meter = runs[way]
            times[way].append(timed_step(model, optimizer, batch, loss_of))
    memory = {way: meter.figures().training_state for way, (_m, _o, meter) in runs.items()}
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"times": times, "memory": memory}))
    rt.shutdown()


def launch(world: int, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    forwarded = [f"--{k}={v}" for k, v in vars(args).items()
                 if k in ("model", "layers", "width", "batch", "rounds", "steps")]
    with tempfile.TemporaryDirectory(prefix="bench-sharded-") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        run_owned([[sys.executable, __file__, "--worker", f"{r},{world},{port},{out}", *forwarded]
                   for r in range(world)], env)
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(world)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("linear", "charlm"), default="linear")
    parser.add_argument("--layers", type=int, default=16, help="blocks")
    parser.add_argument("--width", type=int, default=512, help="the linear layers' width; charlm: d_model")
    parser.add_argument("--batch", type=int, default=32, help="rows per rank; charlm: windows of 64 characters")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        rank, world, port, out = args.worker.split(",")
        return worker(int(rank), int(world), int(port), out, args)
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions))
    model = (f"{args.layers} × Linear({args.width}, {args.width}) + GELU, Adam, {args.batch} rows per rank"
             if args.model == "linear" else f"char LM, {args.layers} blocks of d_model {args.width}, Adam, "
             f"{args.batch} windows of {CONTEXT} characters per rank")
    print(f"model: {model}; load average {os.getloadavg()[0]:.1f}", flush=True)
    result: dict = {}
    for world in (2, 4):
        ranks = launch(world, args)
        peak = {way: max(r["memory"][way] for r in ranks) for way in WAYS}
        median = {way: statistics.median(ranks[0]["times"][way]) for way in WAYS}
        for way in WAYS:
            memory = (f"training state per rank {peak[way] / 2**20:8.2f} MiB ({peak[way] / peak['ddp']:.3f} of ddp)"
                      if way != "keep" else f"{'(every unit gathered after forward)':<51}")
            print(f"{world} ranks  {way:<5} {memory}   step {median[way] * 1e3:8.2f} ms "
                  f"({median[way] / median['ddp']:.3f} of ddp)", flush=True)
        result[f"fsdp{world}_memory_vs_ddp"] = round(peak["fsdp"] / peak["ddp"], 4)
        result[f"fsdp{world}_step_ms"] = round(median["fsdp"] * 1e3, 3)
        result[f"ddp{world}_step_ms"] = round(median["ddp"] * 1e3, 3)
        result[f"hand{world}_step_ms"] = round(median["hand"] * 1e3, 3)
        result[f"keep{world}_step_ms"] = round(median["keep"] * 1e3, 3)
        if world == 2:
            result["fsdp_step_vs_ddp"] = round(median["fsdp"] / median["ddp"], 4)
            result["fsdp_vs_hand_written"] = round(median["hand"] / median["fsdp"], 4)
            result["keep_step_vs_ddp"] = round(median["keep"] / median["ddp"], 4)
    print(f"ratios: fsdp memory vs ddp {result['fsdp2_memory_vs_ddp']} (2 ranks), {result['fsdp4_memory_vs_ddp']} "
          f"(4 ranks); fsdp step vs ddp {result['fsdp_step_vs_ddp']}; hand-written vs ours "
          f"{result['fsdp_vs_hand_written']}")
    result["load_average"] = round(os.getloadavg()[0], 2)
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
