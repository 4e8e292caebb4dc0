"""Train a small character-level transformer on a text with torchrelay.train.

Runs unchanged as ``python train.py`` (one process), under ``torchrun --nproc-per-node 2
train.py`` and as a torchrelay job; the job spec's ``strategy`` (ddp, local_sgd, diloco,
final_average) decides how replicas synchronise, or shards them (fsdp; ``{"kind": "fsdp",
"tensor_parallel": 2}`` also splits each block's attention and MLP over pairs of workers), and
outside a job ``RELAY_STRATEGY='{"kind": "local_sgd", "every": 16}'`` does the same. Reports loss (and the
strategy's bytes_sent / divergence) every step and val_loss every ``--eval-every`` steps,
checkpoints per the job's policy and resumes from the newest checkpoint, and ends with the line
``final val_loss=…``.

``--data`` is a UTF-8 text file (default: Python's own sources, ``data.stdlib_text()``, which
every installation has), learned in memory from random windows for ``--steps`` steps; or the
URL of a store packed by ``pack.py`` (``s3://…``, ``hdfs://…``, a shared folder), whose windows
are streamed with ``rt.stream`` (fetched ahead, cached on local disk, shuffled in a buffer):
every window once per epoch across the ranks, for ``--epochs`` epochs (or until ``--steps``),
the stream's position checkpointed so a restarted job resumes mid-epoch. The same model and
loss either way.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import torchrelay.train as rt
from data import CharCorpus, read_vocabulary, stdlib_text, stored_val_batches, window_batch
from model import CharLM, CharLMConfig, lm_loss
from torchrelay.train import sync

IN_MEMORY_STEPS = 400
DEFAULT_CONTEXT = 64


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=None, help="UTF-8 text file, or store URL packed by pack.py "
                        "(default: Python's own sources, in memory)")
    parser.add_argument("--steps", type=int, default=None, help=f"optimizer steps per worker (in memory: "
                        f"default {IN_MEMORY_STEPS}; from a store: stop at this step, default all of --epochs)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over a store's windows")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per worker per step")
    parser.add_argument("--context", type=int, default=None, help=f"characters per window (default "
                        f"{DEFAULT_CONTEXT}; a store's are as packed)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--record-windows", default=None, metavar="DIR", help="from a store: append the start "
                        "offset of every window this rank trains on to DIR/rank-R.txt, a line per step")
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean validation loss of this replica (no collective, so any strategy may call it)."""
    model.eval()
    losses = [float(lm_loss(model(x.to(device)), y.to(device))) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def evaluates(ctx) -> bool:
    """Whether this rank takes validation losses: the main one, or every one under fsdp, where
    a sharded model's forward is collective (every rank gathers each block)."""
    return ctx.is_main or ctx.strategy.kind == "fsdp"


class Trainer:
    """The model, its optimizer and one training step, shared by the in-memory and store paths."""

    def __init__(self, args: argparse.Namespace, ctx, vocab_size: int, context: int, val):
        self.args, self.ctx, self.val = args, ctx, val
        cfg = CharLMConfig(vocab_size=vocab_size, context=context, d_model=args.d_model,
                           n_heads=args.heads, n_layers=args.layers)
        torch.manual_seed(args.seed)
        model = CharLM(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        self.model, self.optimizer = rt.prepare(model, optimizer)
        self.share, self.shares = rt.data_share()  # the ranks of a tensor-parallel group read the same batch
        self.last = time.perf_counter()

    def step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, **metrics) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(self.model(inputs.to(self.ctx.device)), targets.to(self.ctx.device))
        loss.backward()
        self.optimizer.step()
        now = time.perf_counter()
        rt.report(step, loss=loss.item(), step_time_s=now - self.last,
                  tokens_per_s=inputs.numel() * self.shares / (now - self.last), **metrics)
        self.last = now
        if step % self.args.eval_every == 0 and evaluates(self.ctx):
            val_loss = evaluate(rt.unwrap(self.model), self.val, self.ctx.device)
            rt.report(step, val_loss=val_loss)
            if self.ctx.is_main:
                print(f"step {step} loss={loss.item():.4f} val_loss={val_loss:.4f}", flush=True)

    def before_checkpoint(self) -> None:
        # collective for final_average (the checkpoint holds the average); harmless to repeat
        getattr(self.optimizer, "before_checkpoint", lambda: None)()


def train_in_memory(args: argparse.Namespace, ctx) -> tuple[Trainer, int]:
    """Random windows of the text, fixed by (seed, step, rank), for ``--steps`` steps."""
    corpus = CharCorpus.from_file(args.data) if args.data else CharCorpus.from_text(stdlib_text())
    context = args.context or DEFAULT_CONTEXT
    val = corpus.val_batches(batch_size=args.batch_size, context=context, batches=args.val_batches)
    trainer = Trainer(args, ctx, corpus.vocab_size, context, val)
    steps = args.steps or IN_MEMORY_STEPS
    step = 0
    resumed = rt.load_checkpoint()
    if resumed is not None:
        state, step = resumed
        # under fsdp the prepared model takes whole tensors and keeps its shards; elsewhere the user's model
        (trainer.model if ctx.strategy.kind == "fsdp" else rt.unwrap(trainer.model)).load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        if ctx.is_main:
            print(f"resumed from the checkpoint at step {step}", flush=True)
    for step in range(step + 1, steps + 1):
        trainer.step(step, *corpus.train_batch(step, trainer.share, batch_size=args.batch_size,
                                               context=context, seed=args.seed))
        if rt.checkpoint_due(step):
            trainer.before_checkpoint()
            rt.save_checkpoint({"model": rt.unwrap(trainer.model).state_dict(),
                                "optimizer": trainer.optimizer.state_dict()}, step)
    return trainer, steps


def train_from_store(args: argparse.Namespace, ctx) -> tuple[Trainer, int]:
    """The store's windows, streamed: ``--epochs`` passes (or up to ``--steps``), resumable mid-epoch."""
    # every rank the same number of steps (even): DDP's collectives need it
    loader = rt.stream(args.data, batch_size=args.batch_size, seed=args.seed, shuffle_buffer=4096, even=True)
    vocabulary = read_vocabulary(loader)
    if args.context not in (None, vocabulary["context"]):
        raise ValueError(f"--context {args.context} but {args.data} was packed with windows of "
                         f"{vocabulary['context']}; pack it again with pack.py --context {args.context}")
    val = stored_val_batches(args.data, batch_size=args.batch_size, batches=args.val_batches) \
        if evaluates(ctx) else []
    trainer = Trainer(args, ctx, len(vocabulary["chars"]), vocabulary["context"], val)
    total = min(len(loader) * args.epochs, args.steps or len(loader) * args.epochs)
    state = rt.TrainState(trainer.model, trainer.optimizer, loader)  # model, optimizer, position in the data, RNGs
    if state.restore() and ctx.is_main:
        print(f"resumed from the checkpoint at step {state.step} (epoch {state.epoch + 1})", flush=True)
    record = _window_recorder(args.record_windows, ctx.rank)
    for epoch in state.epochs(args.epochs):
        if state.step >= total:  # --steps reached (now or by the run this one resumes)
            break
        for batch in state.batches():
            record(epoch, state.step, batch["start"])
            trainer.step(state.step, *window_batch(batch), total_steps=total, epoch=epoch)
            if rt.checkpoint_due(state.step):
                trainer.before_checkpoint()
                state.save()
            if state.step >= total:
                break
    rt.wait_for_checkpoint()  # an async save still in flight is committed before the job ends
    loader.close()
    return trainer, total


def _window_recorder(folder: str | None, rank: int):
    if folder is None:
        return lambda epoch, step, starts: None
    os.makedirs(folder, exist_ok=True)
    path = Path(folder) / f"rank-{rank}.txt"

    def record(epoch: int, step: int, starts: torch.Tensor) -> None:
        with path.open("a") as out:
            out.write(f"{epoch} {step} {' '.join(str(int(s)) for s in starts)}\n")
    return record


def is_store(data: str | None) -> bool:
    """True for a store URL or folder, False for a text file (or none). Raises
    ``FileNotFoundError`` for a local path that is neither."""
    if data is None or os.path.isfile(data):
        return False
    if "://" not in data and not os.path.isdir(data):
        raise FileNotFoundError(f"--data {data!r} is neither a text file nor a folder; give a UTF-8 text file "
                                "or the store URL of windows packed by pack.py")
    return True


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = rt.init()
    trainer, steps = train_from_store(args, ctx) if is_store(args.data) else train_in_memory(args, ctx)
    sync.finish(trainer.model, trainer.optimizer)  # replicas agree before the final figure (idempotent)
    if evaluates(ctx):
        val_loss = evaluate(rt.unwrap(trainer.model), trainer.val, ctx.device)
        rt.report(steps, val_loss=val_loss)
        if ctx.is_main:
            print(f"final val_loss={val_loss:.4f}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
