"""Not a test module: a training script for the parameter-server tests and bench, run as W + S real processes.

Configured by the JSON in ``PS_JOB``: ``strategy`` (a parameter_server spec), ``task``
("digits": train an MLP on sklearn digits and report test accuracy; "equiv": fixed batches
for the sync == single-process check), ``steps``/``epochs``, ``batch``, ``out`` (directory for
``rank<N>.json`` / ``rank<N>.pt``) and test hooks: ``slow`` {rank, sleep_s, pause_after,
pause_s, hold_until_peer_steps}, ``pause_at`` {rank, step} (wait for store key "resume") and
``kill_shard`` {rank, step, shard} (that worker SIGKILLs the shard's process, whose pid the
supervisor published, once the other worker waits inside that round).
Rank/world come from torchrun (``--torchrun``: init_process_group and the default store) or
from RANK/WORLD_SIZE with RELAY_PS_STORE.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import types

import torch
import torch.distributed as dist

from torchrelay.spec import ParameterServerStrategy
import torchrelay.train.ps as ps
from torchrelay.train.ps.rendezvous import ShardDirectory, resolve_store


def make_model(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def digits(cache: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn digits scaled to [0, 1], shuffled with a fixed seed (``cache``: a saved copy)."""
    if cache and os.path.exists(cache):
        return torch.load(cache)
    from sklearn.datasets import load_digits
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(1))
    if cache:
        torch.save((X[perm], y[perm]), cache)
    return X[perm], y[perm]


def main() -> None:
    cfg = json.loads(os.environ["PS_JOB"])
    strategy = ParameterServerStrategy.model_validate(cfg["strategy"])
    torchrun = "--torchrun" in sys.argv
    if torchrun:
        dist.init_process_group("gloo")
        ctx = types.SimpleNamespace(rank=dist.get_rank(), world_size=dist.get_world_size(), strategy=strategy)
    else:
        ctx = types.SimpleNamespace(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    strategy=strategy)
    ps.run_server_role_if_assigned(ctx)          # a server rank never comes back from here
    rank, workers = ps.worker_world(ctx)
    store = resolve_store(ctx)
    torch.manual_seed(0)


    def make_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


    def digits():
        from sklearn.datasets import load_digits
        X, y = load_digits(return_X_y=True)
        X = torch.tensor(X / 16.0, dtype=torch.float32)
        y = torch.tensor(y)
        perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(1))
        return X[perm], y[perm]


    X, y = digits()
    Xtr, ytr, Xte, yte = X[:1400], y[:1400], X[1400:], y[1400:]
    model, opt = ps.prepare(make_model(), None, strategy, ctx)
    B = cfg.get("batch", 32)
    slow = cfg.get("slow") or {}
    pause = cfg.get("pause_at") or {}
    if cfg["task"] == "equiv":  # step t: worker r takes rows [t*W*B + r*B, +B)
        batches = [(t * workers * B + rank * B) % (len(Xtr) - B) for t in range(cfg["steps"])]
    else:
        per_epoch = list(range(rank * B, len(Xtr) - workers * B + 1, workers * B))
        batches = per_epoch * cfg.get("epochs", 5)
    kill = cfg.get("kill_shard") or {}
    directory = ShardDirectory(store)
    for step, start in enumerate(batches):
        if pause.get("rank") == rank and pause.get("step") == step:
            store.set("paused", "1")
            store.wait(["resume"])
        if kill.get("rank") == rank and kill.get("step") == step:
            # the other worker has finished the previous round and now waits in this one
            while store.add(f"progress{1 - rank}", 0) < step:
                time.sleep(0.01)
            _, _, _, pid = directory.lookup(kill["shard"])
            os.kill(pid, signal.SIGKILL)
            directory.lookup(kill["shard"], newer_than=1)  # its supervisor restarted it
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(Xtr[start:start + B]), ytr[start:start + B])
        loss.backward()
        opt.step()
        store.add(f"progress{rank}", 1)
        if slow.get("rank") == rank:
            if slow.get("hold_until_peer_steps") and step == 0:
                while store.add(f"progress{1 - rank}", 0) < slow["hold_until_peer_steps"]:
                    time.sleep(0.01)
            if slow.get("pause_s") and step == 0:
                time.sleep(slow["pause_s"])
            time.sleep(slow.get("sleep_s", 0.0))
    metrics = opt.metrics()
    opt.pull()
    with torch.no_grad():
        acc = (model(Xte).argmax(1) == yte).float().mean().item()
    out = cfg["out"]
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(out, f"rank{rank}.pt"))
    if cfg.get("save_state") and rank == 0:
        torch.save(opt.state_dict(), os.path.join(out, "ps_state.pt"))
    opt.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "acc": acc, "steps": len(batches),
                   "generations": [directory.lookup(i)[0] for i in range(strategy.servers)], **metrics}, f)
    if torchrun:
        total = torch.ones(1)
        dist.all_reduce(total, group=ps.worker_process_group())  # workers only: servers have left
        assert total.item() == workers, total
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
