"""Trains from a sharded dataset in the store and records which samples each step trained on.

    python stream_trainer.py DATA_URL RECORD_DIR [--epochs 2] [--batch 4] [--sleep 0.1]

Every sample carries its own number (field ``id``). After each step a rank appends
``attempt step epoch id id …`` to ``RECORD_DIR/rank-R.txt``, so a test can rebuild what the
run trained on across a restart: the steps of an attempt up to the checkpoint the next one
resumed from, then the next attempt's. Checkpoints follow the job's policy through
``TrainState``, which keeps the stream's position; after a restore it reports ``resumed_from``.
Rank 0 saves ``model.pt``.
"""
import argparse
import json
import os
import time

import torch

import torchrelay.train as rt

parser = argparse.ArgumentParser()
parser.add_argument("data")
parser.add_argument("records")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--sleep", type=float, default=0.1)
args = parser.parse_args()


def main() -> None:
    ctx = rt.init()
    # the environment this rank runs with, for the test to check (a rank forked warm by the agent
    # has its variables set in-process: /proc/PID/environ shows its zygote's, not these)
    with open(os.path.join(args.records, f"env-a{ctx.attempt}-rank-{ctx.rank}.json"), "w") as fh:
        json.dump(dict(os.environ), fh)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    model, optimizer = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = rt.stream(args.data, batch_size=args.batch, shuffle_buffer=16, seed=3, even=True)
    state = rt.TrainState(model, optimizer, loader)
    if state.restore():
        print(f"rank {ctx.rank}: resumed from step {state.step}", flush=True)
        rt.report(state.step, resumed_from=state.step, attempt=ctx.attempt)
    record = open(os.path.join(args.records, f"rank-{ctx.rank}.txt"), "a")
    for epoch in state.epochs(args.epochs):
        for batch in state.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]).squeeze(1), batch["x"].sum(1))
            loss.backward()
            optimizer.step()
            record.write(f"{ctx.attempt} {state.step} {epoch} {' '.join(map(str, batch['id'].tolist()))}\n")
            record.flush()
            rt.report(state.step, loss=loss.item(), attempt=ctx.attempt)
            if rt.checkpoint_due(state.step):
                state.save()
            time.sleep(args.sleep)
    if ctx.is_main:
        rt.save_artifact("model.pt", rt.unwrap(model).state_dict())
    rt.shutdown()


main()
