"""mpirun's remote shell for an mpirun job: hands a node's Open MPI daemon to that node's agent.

``python -m torchrelay.agent.mpi_rsh HOST COMMAND...`` is what mpirun runs instead of ``ssh HOST
COMMAND...`` (``-mca plm_rsh_agent``, see ``torchrelay.agent.mpi``). It writes the command line
to ``$RELAY_LAUNCH_DIR/mpi/daemon-<k>.json`` (atomically: a temporary file renamed) for node 0's
agent to pass on, and exits 0 at once; the daemon then calls mpirun back over TCP as it would
after ssh. Exits 2 (mpirun then reports the daemon as failed to start) when HOST is not one of
the job's nodes or there is no launch folder. Standard library only: it runs at every MPI start.
"""
from __future__ import annotations

import json
import os
import sys

from torchrelay.agent.mpi import handoff_path, handoff_record


def main(argv: list[str]) -> int:
    args = [a for a in argv if a]
    while args and args[0].startswith("-"):  # ssh-style options mpirun may add (e.g. -x): none apply
        args.pop(0)
    if len(args) < 2:
        print(f"torchrelay mpi_rsh: usage: HOST COMMAND...; got {argv!r}", file=sys.stderr)
        return 2
    host, command = args[0], args[1:]
    run_dir = os.environ.get("RELAY_LAUNCH_DIR")
    if not run_dir:
        print("torchrelay mpi_rsh: RELAY_LAUNCH_DIR is not set: not run by a torchrelay launch", file=sys.stderr)
        return 2
    try:
        record = handoff_record(host, command)
    except ValueError as exc:
        print(f"torchrelay mpi_rsh: {exc}", file=sys.stderr)
        return 2
    path = handoff_path(run_dir, record["node_rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
