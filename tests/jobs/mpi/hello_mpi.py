"""An unchanged mpi4py script (nothing of torchrelay or torch.distributed): allreduce, rank, size.

Modes: ``ok``; ``fail`` (the last rank prints and exits 3, the others wait in a barrier the
platform must end); ``fail-once`` (so, in the job's first attempt only); ``sleep`` (every rank
prints forever, for cancel).
"""
import os
import sys
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
total = comm.allreduce(rank + 1, op=MPI.SUM)
assert total == size * (size + 1) // 2, (total, size)
name = MPI.Get_processor_name()
print(f"mpi rank {rank}/{size} sum={total}", flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
if mode == "fail-once":
    mode = "fail" if os.environ.get("RELAY_ATTEMPT") == "1" else "ok"
if mode == "fail" and rank == size - 1:
    print("rank about to fail with code 3", flush=True)
    sys.exit(3)
if mode == "fail":
    comm.Barrier()  # never completes: the failed rank does not come
if mode == "sleep":
    while True:
        print(f"mpi rank {rank} still working", flush=True)
        time.sleep(0.2)
comm.Barrier()
