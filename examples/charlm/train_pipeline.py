"""Train the char LM pipelined across the job's workers (strategy `pipeline`).

The model is built on the meta device as a list of blocks (embedding, transformer blocks,
head); ``torchrelay.train.pipeline.prepare`` profiles the blocks on the devices the job got,
plans the cut (printed, and shown by ``relay status``), and each stage materialises only its
own blocks. Stage 0 reads the inputs, the last stage the targets; the loss is reported by the
last stage. Run as a job:

    relay run --workers 2 --strategy pipeline -- python train_pipeline.py --data FILE

or under torchrun with ``RELAY_STRATEGY='{"kind": "pipeline", "microbatches": 8}'``.
"""
from __future__ import annotations

import argparse
import time

import torch

import torchrelay.train as rt
from data import CharCorpus
from model import CharLMConfig, build_blocks, lm_loss
from torchrelay.train import pipeline as pp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="UTF-8 text file to learn")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="windows per step (split into micro-batches)")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = rt.init()
    corpus = CharCorpus.from_file(args.data)
    cfg = CharLMConfig(vocab_size=corpus.vocab_size, context=args.context, d_model=args.d_model,
                       n_heads=args.heads, n_layers=args.layers)
    micro = max(1, args.batch_size // ctx.strategy.microbatches) if ctx.strategy.kind == "pipeline" else 4
    sample_x, sample_y = corpus.train_batch(0, 0, batch_size=micro, context=args.context, seed=args.seed)
    blocks = pp.build_on_meta(lambda: build_blocks(cfg))
    pipe = pp.prepare(blocks, lm_loss, ctx=ctx, sample=sample_x, sample_target=sample_y, seed=args.seed)
    if ctx.is_main:
        print(pipe.plan.describe(), flush=True)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr, weight_decay=0.0)
    last = time.perf_counter()
    for step in range(1, args.steps + 1):
        # every replica's first and last stage draw the same batch: inputs there, targets here
        inputs, targets = corpus.train_batch(step, pipe.replica, batch_size=args.batch_size,
                                             context=args.context, seed=args.seed)
        loss = pipe.step(inputs if pipe.is_first else None, targets if pipe.is_last else None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if pipe.is_last:
            rt.report(step, loss=float(loss), step_time_s=now - last, total_steps=args.steps,
                      tokens_per_s=inputs.numel() / (now - last))
            if step % 50 == 0 or step == args.steps:
                print(f"step {step}/{args.steps} loss={float(loss):.4f}", flush=True)
        last = now
    if pipe.is_last:
        print(f"final loss={float(loss):.4f}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
