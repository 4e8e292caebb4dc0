"""An elastic DDP job for the tests and the bench: a small regression model trained on a fixed
dataset, each member logging per step its loss, samples, membership and pid to
``$OUT/member-<id>.jsonl``, and its final parameters to ``$OUT/final-<id>.pt``.

    python train.py [--epochs 2] [--step-sleep 0] [--leave-at STEP --leaver ID] [--hold-at STEP]  (with the job)
    python train.py --join ID                                                      (a joiner)

``--leave-at``: member ``--leaver`` exits (code 0) right before the all-reduce of that step, the
replay of a kill at that step. A joiner needs MASTER_ADDR/MASTER_PORT of the job's store.
"""
import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

from problem import GLOBAL_BATCH, SAMPLES, make_problem

from torchrelay.train.elastic import ElasticGroup

STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--leave-at", type=int, default=-1)
parser.add_argument("--leaver", type=int, default=-1)
parser.add_argument("--join", type=int, default=None)
parser.add_argument("--hold-at", type=int, default=-1, help="before this step, wait until a joiner registered")
args = parser.parse_args()
out = os.environ["OUT"]
X, Y, model, opt = make_problem()


def order(epoch):
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


def pack(steps_done):
    return {"model": model.state_dict(), "opt": opt.state_dict(), "steps_done": steps_done}


if args.join is None:
    group = ElasticGroup.from_env()
    member = group.member
else:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    group = ElasticGroup.join(store, args.join, min_workers=1, max_workers=4)
    member = args.join
log = open(os.path.join(out, f"member-{member}.jsonl"), "a")
steps_done, total = 0, args.epochs * STEPS_PER_EPOCH
while steps_done < total:
    if group.needs_sync:
        mine = pack(steps_done) if args.join is None or steps_done else None
        if mine is not None:
            torch.save(mine, os.path.join(out, f"before-sync-{group.membership.epoch}-{member}.pt"))
        state = group.sync_state(mine)
        torch.save(state, os.path.join(out, f"after-sync-{group.membership.epoch}-{member}.pt"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        steps_done = state["steps_done"]
    if steps_done == args.hold_at:  # a test's joiner starts cold: keep the job running until it is there
        deadline = time.monotonic() + 120
        while group.store.add("joiners/next", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    epoch, step = divmod(steps_done, STEPS_PER_EPOCH)
    start, stop = group.batch_range(SAMPLES, GLOBAL_BATCH, step)
    idx = order(epoch)[start:stop]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx], reduction="sum") / GLOBAL_BATCH
    loss.backward()
    if steps_done == args.leave_at and member == args.leaver:
        log.close()
        os._exit(0)
    if not group.all_reduce_gradients(model.parameters(), steps_done):
        continue  # the membership changed: sync, then redo this step
    opt.step()
    log.write(json.dumps({"step": steps_done, "epoch": group.membership.epoch, "members": list(group.membership.members),
                          "loss": loss.item(), "samples": idx, "pid": os.getpid(), "time": time.time()}) + "\n")
    log.flush()
    steps_done += 1
    group.step_done(steps_done)
    time.sleep(args.step_sleep)
torch.save(model.state_dict(), os.path.join(out, f"final-{member}.pt"))
with open(os.path.join(out, f"history-{member}.json"), "w") as fh:
    json.dump([m.to_json() for m in group.history], fh)
