"""One rank of an mpirun job: torch.distributed's variables from Open MPI's, then the exit hook.

``python -m torchrelay.agent.mpi_rank WORKER_ARGV...`` is what mpirun starts for every rank (see
``torchrelay.agent.mpi``). It sets ``RANK``, ``LOCAL_RANK`` and ``ROLE_RANK`` from
``OMPI_COMM_WORLD_*`` (the node's other variables, ``WORLD_SIZE``, ``MASTER_ADDR``, ``RELAY_*``,
came with its launch), moves to the node's own copy of the job's code (mpirun starts remote
ranks in node 0's folder), and becomes ``python -m torchrelay.agent.worker WORKER_ARGV...`` (the
same exit hook, rank log and marker as under torchrun). The process stays the one Open MPI
started (``exec``), so mpirun's signals and exit codes reach the rank directly. Exits 2 when the
rank is not where the server placed it. Standard library only.
"""
from __future__ import annotations

import os
import sys

from torchrelay.agent.mpi import CODE_DIR_VAR, rank_env
from torchrelay.agent.target import WORKER_MODULE


def main(argv: list[str]) -> int:
    try:
        os.environ.update(rank_env(os.environ))
    except ValueError as exc:
        print(f"torchrelay mpi_rank: {exc}", file=sys.stderr)
        return 2
    code_dir = os.environ.get(CODE_DIR_VAR)
    if code_dir:
        os.chdir(code_dir)
    os.execv(sys.executable, [sys.executable, "-m", WORKER_MODULE, *argv])
    return 127  # not reached: exec either replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
