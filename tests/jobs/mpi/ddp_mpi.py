"""A DDP script launched by mpirun: MPI for rank and size, gloo (torch.distributed) for gradients.

Every rank checks that the torch.distributed environment the platform gave it agrees with MPI's
world, trains a small model a few steps with DistributedDataParallel, and checks that every
rank ends with the same parameters (an MPI allreduce of their checksum).
"""
import gc
import os

import torch
import torch.distributed as dist
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (rank, size), (os.environ["RANK"], rank)
assert int(os.environ["LOCAL_RANK"]) == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(rank)
for step in range(5):
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
with torch.no_grad():
    checksum = float(sum(p.sum() for p in model.parameters()))
sums = comm.allgather(round(checksum, 5))
assert len(set(sums)) == 1, sums
print(f"ddp rank {rank}/{size} loss={loss.item():.4f} params={checksum:.5f} same on all ranks", flush=True)
del model, opt
gc.collect()  # DDP's reducer before the group (docs/design.md, exit-time abort)
dist.destroy_process_group()
