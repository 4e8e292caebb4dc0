"""Train a small character-level transformer on a text file with torchrelay.train.

Runs unchanged as ``python train.py --data FILE`` (one process), under
``torchrun --nproc-per-node 2 train.py --data FILE`` and as a torchrelay job; the job spec's
``strategy`` (ddp, local_sgd, diloco, final_average) decides how replicas synchronise, or
shards them (fsdp; ``{"kind": "fsdp", "tensor_parallel": 2}`` also splits each block's attention
and MLP over pairs of workers), and outside a job
``RELAY_STRATEGY='{"kind": "local_sgd", "every": 16}'`` does the same. Reports
loss (and the strategy's bytes_sent / divergence) every step and val_loss every
``--eval-every`` steps, checkpoints per the job's policy and resumes from the newest
checkpoint, and ends with the line ``final val_loss=…``.

Any UTF-8 text works; ``bench/sync.py`` and the tests use Python's own sources
(``data.stdlib_text()``), which every installation has.
"""
from __future__ import annotations

import argparse
import time

import torch

import torchrelay.train as rt
from data import CharCorpus
from model import CharLM, CharLMConfig, lm_loss
from torchrelay.train import sync


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="UTF-8 text file to learn")
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps per worker")
    parser.add_argument("--batch-size", type=int, default=16, help="windows per worker per step")
    parser.add_argument("--context", type=int, default=64, help="characters per window")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--val-batches", type=int, default=8)
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean validation loss of this replica (no collective, so any strategy may call it)."""
    model.eval()
    losses = [float(lm_loss(model(x.to(device)), y.to(device))) for x, y in batches]
    model.train()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = rt.init()
    corpus = CharCorpus.from_file(args.data)
    cfg = CharLMConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model,
                       n_heads=args.heads, n_layers=args.layers)
    torch.manual_seed(args.seed)
    model = CharLM(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model, optimizer = rt.prepare(model, optimizer)
    val = corpus.val_batches(batch_size=args.batch_size, context=args.context, batches=args.val_batches)

    step = 0
    resumed = rt.load_checkpoint()
    if resumed is not None:
        state, step = resumed
        # under fsdp the prepared model takes whole tensors and keeps its shards; elsewhere the user's model
        (model if ctx.strategy.kind == "fsdp" else rt.unwrap(model)).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if ctx.is_main:
            print(f"resumed from the checkpoint at step {step}", flush=True)

    share, shares = rt.data_share()  # the ranks of a tensor-parallel group read the same batch
    last = time.perf_counter()
    for step in range(step + 1, args.steps + 1):
        inputs, targets = corpus.train_batch(step, share, batch_size=args.batch_size,
                                             context=args.context, seed=args.seed)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs.to(ctx.device)), targets.to(ctx.device))
        loss.backward()
        optimizer.step()
        now = time.perf_counter()
        rt.report(step, loss=loss.item(), step_time_s=now - last,
                  tokens_per_s=inputs.numel() * shares / (now - last))
        last = now
        if rt.checkpoint_due(step):
            # collective for final_average (the checkpoint holds the average); harmless to repeat
            getattr(optimizer, "before_checkpoint", lambda: None)()
            rt.save_checkpoint({"model": rt.unwrap(model).state_dict(), "optimizer": optimizer.state_dict()}, step)
        # a sharded model's forward is collective (every rank gathers each block): all ranks evaluate
        evaluates = ctx.is_main or ctx.strategy.kind == "fsdp"
        if step % args.eval_every == 0 and evaluates:
            val_loss = evaluate(rt.unwrap(model), val, ctx.device)
            rt.report(step, val_loss=val_loss)
            if ctx.is_main:
                print(f"step {step}/{args.steps} loss={loss.item():.4f} val_loss={val_loss:.4f}", flush=True)

    sync.finish(model, optimizer)  # replicas agree before the final figure (idempotent; shutdown may repeat it)
    if evaluates:
        val_loss = evaluate(rt.unwrap(model), val, ctx.device)
        rt.report(args.steps, val_loss=val_loss)
        if ctx.is_main:
            print(f"final val_loss={val_loss:.4f}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
