"""An elastic local SGD or DiLoCo job for the tests (the strategy is ``RELAY_STRATEGY``'s): the
problem of ``train.py``, each member logging per completed step its loss, samples, membership
and pid to ``$OUT/member-<id>.jsonl``, its state after every membership change to
``$OUT/state-<epoch>-<id>.pt``, after every sync point to ``$OUT/anchor-<epoch>-<steps>-<id>.pt``
and its final parameters to ``$OUT/final-<id>.pt``.

    python train_sync.py [--epochs 2] [--step-sleep 0] [--leave-at STEP --leaver ID] [--hold-at STEP]
    python train_sync.py --join ID                                     (a joiner)

``--leave-at``: member ``--leaver`` exits (code 0) before its local step STEP (a sync point's
step): the replay of a kill in the period after that sync point. ``--hold-at``: before that
step, the members wait until a joiner registered. A joiner needs MASTER_ADDR/MASTER_PORT.
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
from torchrelay.train.elastic_sync import ElasticSync

STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--leave-at", type=int, default=-1)
parser.add_argument("--leaver", type=int, default=-1)
parser.add_argument("--join", type=int, default=None)
parser.add_argument("--hold-at", type=int, default=-1)
args = parser.parse_args()
out = os.environ["OUT"]
X, Y, model, opt = make_problem()


def order(epoch):
    return torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch)).tolist()


if args.join is None:
    group = ElasticGroup.from_env()
else:
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    group = ElasticGroup.join(store, args.join, min_workers=1, max_workers=4)
member = group.member
sync = ElasticSync(group, model, opt)


def dump_state(name=None):
    torch.save({"model": model.state_dict(), "opt": sync.optimizer.state_dict()},
               os.path.join(out, f"{name or f'state-{group.membership.epoch}'}-{member}.pt"))


if args.join is not None:
    dump_state()
log = open(os.path.join(out, f"member-{member}.jsonl"), "a")
while not sync.finished(args.epochs * STEPS_PER_EPOCH):
    done = sync.steps_done
    if done == args.hold_at:  # a test's joiner starts cold: keep the job running until it is there
        deadline = time.monotonic() + 120
        while group.store.add("joiners/next", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    if done == args.leave_at and member == args.leaver:
        log.close()
        os._exit(0)
    epoch, step = divmod(done, STEPS_PER_EPOCH)
    start, stop = group.batch_range(SAMPLES, GLOBAL_BATCH, step)
    idx = order(epoch)[start:stop]
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X[idx]), Y[idx])  # this member's mean: its step is local
    loss.backward()
    trained_in, members = group.membership.epoch, list(group.membership.members)
    if sync.step():
        log.write(json.dumps({"step": done, "epoch": trained_in, "members": members, "loss": loss.item(),
                              "samples": idx, "pid": os.getpid()}) + "\n")
        log.flush()
        if sync.anchor_step == sync.steps_done and group.membership.epoch == trained_in:
            dump_state(f"anchor-{trained_in}-{sync.steps_done}")
    if group.membership.epoch != trained_in:  # a membership change: back at a sync point
        dump_state()
    time.sleep(args.step_sleep)
torch.save(model.state_dict(), os.path.join(out, f"final-{member}.pt"))
with open(os.path.join(out, f"history-{member}.json"), "w") as fh:
    json.dump([m.to_json() for m in group.history], fh)
