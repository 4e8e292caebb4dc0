"""A DDP script launched by mpirun: MPI for rank and size, gloo through torchrelay.train for the rest.

Every rank checks that the torch.distributed environment the platform gave it agrees with MPI's
world, trains a small model a few steps with ``torchrelay.train`` (its gloo group, DDP,
metrics, a checkpoint of ``TrainState``), and checks that every rank ends with the same
parameters (an MPI allgather of their checksum).
"""
import os

import torch
from mpi4py import MPI

import torchrelay.train as rt

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
assert (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (rank, size), (os.environ["RANK"], rank)
assert int(os.environ["LOCAL_RANK"]) == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
ctx = rt.init()
assert (ctx.rank, ctx.world_size) == (rank, size)
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
model, opt = rt.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
state = rt.TrainState(model, opt)
gen = torch.Generator().manual_seed(rank)
for step in range(1, 6):
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 2, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    state.step = step
    rt.report(step, loss=loss.item())
state.save(async_=False)  # every rank: one checkpoint at step 5
with torch.no_grad():
    checksum = float(sum(p.sum() for p in model.parameters()))
sums = comm.allgather(round(checksum, 5))
assert len(set(sums)) == 1, sums
print(f"ddp rank {rank}/{size} loss={loss.item():.4f} params={checksum:.5f} same on all ranks", flush=True)
rt.shutdown()
