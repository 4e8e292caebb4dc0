"""A plain torchrun script (no torchrelay import): all-reduce ranks and print the sum."""
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert int(os.environ["WORLD_SIZE"]) == world and "MASTER_PORT" in os.environ and "LOCAL_RANK" in os.environ
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{world} sum={t.item():g}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "sleep":
    while True:
        print(f"rank {rank} still working", flush=True)
        time.sleep(0.2)
if mode == "fail" and rank == world - 1:
    print("about to fail with code 3", flush=True)
    sys.exit(3)
if mode == "fail":
    time.sleep(300)  # the healthy rank would wait a long time: the platform must end it
dist.destroy_process_group()
