"""Synchronisation strategies side by side: bytes per step, final validation loss, wall time.

Two gloo workers on 127.0.0.1 train the char LM (examples/charlm) on the same text, seed and
token budget under each of: ddp; local_sgd with H=4 and H=16; diloco with H=16 (outer lr 0.7,
Nesterov momentum 0.5: this run has only 16 outer steps, too few for the paper's 0.9 to pay
off; docs/strategies.md gives the measured alternatives); and, as the reference for local SGD, PyTorch's own post-local SGD
(``torch.distributed.optim.PostLocalSGDOptimizer`` + ``PeriodicModelAverager``, with DDP and
``post_localSGD_hook``/``PostLocalSGDState`` switched to no gradient all-reduce from step 0)
at H=16. Every run starts from rank 0's seeded weights, uses AdamW, and ends with the
replicas averaged (where they differ) before the validation loss is measured on fixed windows.
One launch runs all of them in sequence, so start-up costs are paid once and the machine's
noise hits all alike.

Bytes per step are what our ``SyncOptimizer.metrics()`` counted at the collectives; for the
PyTorch reference they are computed from its averaging schedule (marked "est.").

    .venv/bin/python bench/sync.py [--text FILE] [--steps 256]

The text is the standard library's own sources and documentation topics (``stdlib_text()`` in
examples/charlm/data.py, about 1.2 MB, shipped with every Python); ``--text FILE`` learns any
other UTF-8 text instead, e.g. a larger corpus.

Ends with ``RESULT {"bytes_ratio_h16": local_sgd H=16 bytes/step × 16 / ddp bytes/step,
"loss_gap_h16": (local_sgd16 - ddp) / ddp, "loss_gap_vs_torch_postlocalsgd": (local_sgd16 -
torch) / torch, "diloco_loss_gap_h16": (diloco16 - ddp) / ddp}`` (final validation losses).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from _env import TRAINING_PACKAGES, header_line, package_versions, result_line  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm"
WORLD = 2
RUNS = ["ddp", "local_sgd_h4", "local_sgd_h16", "diloco_h16", "torch_postlocalsgd_h16"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", "--data", dest="text", default=None,
                        help="UTF-8 text to learn (default: Python's own sources, see the module docstring)")
    parser.add_argument("--steps", type=int, default=256, help="optimizer steps per worker (a multiple of 16)")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per worker per step")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--val-batches", type=int, default=16)
    args = parser.parse_args(argv)
    if args.steps % 16:
        parser.error(f"--steps {args.steps} must be a multiple of 16 so every run ends on a sync point")
    return args


def strategy_for(name: str):
    from torchrelay.spec import DDPStrategy, DiLoCoStrategy, LocalSGDStrategy

    return {"ddp": DDPStrategy(),
            "local_sgd_h4": LocalSGDStrategy(kind="local_sgd", every=4),
            "local_sgd_h16": LocalSGDStrategy(kind="local_sgd", every=16),
            "diloco_h16": DiLoCoStrategy(kind="diloco", every=16, outer_lr=0.7, outer_momentum=0.5)}[name]


def torch_postlocalsgd(model, optimizer, period: int):
    """PyTorch's post-local SGD: DDP without gradient all-reduce after step 0, averaging every ``period``."""
    import torch.distributed.algorithms.model_averaging.averagers as averagers
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                              post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    return ddp, PostLocalSGDOptimizer(optim=optimizer, averager=averagers.PeriodicModelAverager(period=period))


def worker(rank: int, port: int, args: argparse.Namespace, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(CHARLM))
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.utils import average_parameters

    from data import CharCorpus, stdlib_text
    from model import CharLM, CharLMConfig, lm_loss
    from torchrelay.train import sync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    corpus = CharCorpus.from_file(args.text) if args.text else CharCorpus.from_text(stdlib_text())
    cfg = CharLMConfig(vocab_size=corpus.vocab_size, context=args.context)
    val = corpus.val_batches(batch_size=args.batch_size, context=args.context, batches=args.val_batches)
    results = {}
    for name in RUNS:
        torch.manual_seed(args.seed)
        model = CharLM(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if name.startswith("torch_"):
            wrapped, optimizer = torch_postlocalsgd(model, optimizer, period=16)
        else:
            wrapped, optimizer = sync.prepare(model, optimizer, strategy_for(name), _Ctx(rank))
        dist.barrier()
        started = time.perf_counter()
        sent = 0.0
        for step in range(1, args.steps + 1):
            inputs, targets = corpus.train_batch(step, rank, batch_size=args.batch_size, context=args.context,
                                                 seed=args.seed)
            optimizer.zero_grad(set_to_none=True)
            lm_loss(wrapped(inputs), targets).backward()
            optimizer.step()
            if hasattr(optimizer, "metrics"):
                sent += optimizer.metrics()["bytes_sent"]
        if name.startswith("torch_"):
            average_parameters(list(model.parameters()), dist.group.WORLD)  # replicas differ after 15 local steps
            syncs = len(range(0, args.steps, 16))  # PeriodicModelAverager: 0-based steps 0, 16, 32, ...
            sent, estimated = float(syncs * param_bytes), True
        else:
            sync.finish(wrapped, optimizer)
            estimated = False
        dist.barrier()
        wall = time.perf_counter() - started
        with torch.no_grad():
            model.eval()
            val_loss = sum(float(lm_loss(model(x), y)) for x, y in val) / len(val)
        results[name] = {"bytes_per_step": sent / args.steps, "estimated": estimated, "val_loss": val_loss,
                         "wall_s": wall, "param_bytes": param_bytes}
        del wrapped, optimizer, model
        gc.collect()
    if rank == 0:
        Path(outdir, "results.json").write_text(json.dumps(results))
    gc.collect()  # DDP's reducer before the group goes (docs/design.md, exit-time abort)
    dist.destroy_process_group()


class _Ctx:
    def __init__(self, rank: int) -> None:
        self.rank, self.world_size, self.device = rank, WORLD, "cpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    versions = package_versions(TRAINING_PACKAGES)
    print(header_line(versions), flush=True)
    if args.text and not Path(args.text).is_file():
        raise SystemExit(f"--text {args.text!r} is not a file; give a UTF-8 text, or leave --text out to learn "
                         "Python's own sources")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(REPO))
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(worker, args=(free_port(), args, outdir), nprocs=WORLD, join=False,
                                 daemon=True, start_method="spawn")
        try:
            while not ctx.join():
                pass
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join()
        results = json.loads(Path(outdir, "results.json").read_text())

    tokens = args.steps * args.batch_size * args.context * WORLD
    print(f"text: {args.text or 'the standard library (examples/charlm/data.py stdlib_text)'}")
    print(f"char LM, {WORLD} workers, {args.steps} steps × {args.batch_size}×{args.context} tokens per worker "
          f"({tokens:,} tokens), model {results['ddp']['param_bytes']:,} bytes, seed {args.seed}")
    print(f"{'run':<24}{'bytes/step':>14}{'val loss':>10}{'wall s':>9}")
    for name in RUNS:
        r = results[name]
        note = " (est.)" if r["estimated"] else ""
        print(f"{name:<24}{r['bytes_per_step']:>14,.0f}{r['val_loss']:>10.4f}{r['wall_s']:>9.1f}{note}")
    ddp, local16, diloco16 = results["ddp"], results["local_sgd_h16"], results["diloco_h16"]
    reference = results["torch_postlocalsgd_h16"]
    summary = {
        "bytes_ratio_h16": round(local16["bytes_per_step"] * 16 / ddp["bytes_per_step"], 4),
        "loss_gap_h16": round((local16["val_loss"] - ddp["val_loss"]) / ddp["val_loss"], 4),
        "loss_gap_vs_torch_postlocalsgd": round((local16["val_loss"] - reference["val_loss"]) / reference["val_loss"], 4),
        "diloco_loss_gap_h16": round((diloco16["val_loss"] - ddp["val_loss"]) / ddp["val_loss"], 4),
        "text": args.text or "stdlib",
    }
    print(result_line(summary, versions))


if __name__ == "__main__":
    main()
