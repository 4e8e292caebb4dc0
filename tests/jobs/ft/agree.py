"""Ranks agree on a stop request that only one of them received.

Run under torchrun with 2 ranks and ``RELAY_JOB_ID`` set (so ``rt.init`` installs the SIGTERM
handler). Rank 0 sends itself SIGTERM after step ``STOP_AT``'s all-reduce; rank 1 gets none.
Each rank prints ``rank R stopped after step S``: both must stop after the same step, and that
step's ``checkpoint_due`` must have said True (so the stop is committed). The ranks agree at
their periodic agreement all-reduce, so S is at or a little after ``STOP_AT``.
"""
import os
import signal

import torch
import torch.distributed as dist

import torchrelay.train as rt

STOP_AT = 3

ctx = rt.init()
for step in range(1, 5000):
    grad = torch.ones(1)
    dist.all_reduce(grad)  # what a DDP step does
    if ctx.rank == 0 and step == STOP_AT:
        os.kill(os.getpid(), signal.SIGTERM)  # handled: only a request
    due = rt.checkpoint_due(step)
    if rt.should_stop():
        print(f"rank {ctx.rank} stopped after step {step} (checkpoint_due={due})", flush=True)
        break
else:
    print(f"rank {ctx.rank} never stopped", flush=True)
rt.shutdown()
