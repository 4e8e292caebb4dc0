"""MPI jobs: mpirun's command line, the daemon hand-off between agents, and a rank's environment. Pure.

An mpirun job (``launcher: mpirun``) is one Open MPI world across the job's nodes with no ssh
between them (docs/mpi.md). Node 0's agent starts ``mpirun``; mpirun's remote shell is ours
(``-mca plm_rsh_agent``, ``torchrelay.agent.mpi_rsh``), the way the Kubeflow MPI Operator gives
mpirun ``kubectl exec``: for node ``k`` it writes the ``orted`` command line mpirun wants run
there into the launch's ``mpi/`` folder, node 0's agent reports it to the server with its
``running`` status, and node ``k``'s agent, told in a heartbeat reply, runs it in its own launch
(``sh -c``, as sshd would). Ranks on node ``k`` are children of that ``orted``, so they carry
node ``k``'s launch environment: per-rank logs, markers, cancel and blame work as under torchrun.

Contract:
- ``mpirun_command(...)``: the argv of node 0's mpirun; ``mpirun_env(...)``: the ``OMPI_MCA_*``
  defaults every node runs with (a job's ``env`` may override each); ``session_dir``: a node's
  own folder for Open MPI's files.
- ``host_of(node_rank)`` / ``node_rank_of(host)``: the names mpirun knows the nodes by (node 0
  is ``localhost``, mpirun's own; the others never resolve, so mpirun always uses our shell).
- ``handoff_path`` / ``read_handoffs``: the files ``mpi_rsh`` writes and node 0's agent reads.
- ``node_env(...)``: what one node's mpirun or daemon adds for itself alone.
- ``rank_env(environ)``: the torch.distributed variables of one rank from Open MPI's
  ``OMPI_COMM_WORLD_*`` ones (and its node's shared-memory folder). Raises ``ValueError`` (naming the values) when Open MPI put the
  rank on a node other than the one the server gave it.
Standard library only: ``mpi_rsh`` and ``mpi_rank`` import it at every start.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

MPI_FOLDER = "mpi"  # in the launch's run folder: the hand-offs of node 0's mpirun
HOST_SUFFIX = ".relay.invalid"  # RFC 2606: never resolves, so never taken for this host
RSH_MODULE = "torchrelay.agent.mpi_rsh"
RANK_MODULE = "torchrelay.agent.mpi_rank"
RANK_OFFSET_VAR = "RELAY_RANK_OFFSET"  # the node's first rank, as the server placed it
CODE_DIR_VAR = "RELAY_CODE_DIR"  # the node's copy of the job's code, where its ranks run
SHM_DIR_VAR = "RELAY_MPI_SHM_DIR"  # where the node's ranks keep shared memory, if not /dev/shm


def host_of(node_rank: int) -> str:
    """The name mpirun knows node ``node_rank`` of the job by."""
    return "localhost" if node_rank == 0 else f"node{node_rank}{HOST_SUFFIX}"


def node_rank_of(host: str) -> int:
    """The node rank of a name ``host_of`` gave. Raises ``ValueError`` on any other name."""
    if host.endswith(HOST_SUFFIX) and host.startswith("node"):
        digits = host[len("node"):-len(HOST_SUFFIX)]
        if digits.isdigit() and int(digits) > 0:
            return int(digits)
    raise ValueError(f"host {host!r} is not one of this job's MPI nodes (node<k>{HOST_SUFFIX}, k >= 1)")


def session_dir(run_dir: str | Path, temp_root: str = "/tmp") -> str:
    """Where this node's Open MPI keeps its session files (``orte_tmpdir_base``): one folder per
    launch, so that two agents on one machine never share them; short, because Open MPI puts
    unix sockets in it (108 bytes at most) and a launch's run folder can be deep."""
    digest = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    return os.path.join(temp_root, f"relay-mpi-{digest}")


def mpirun_env(master_addr: str) -> dict[str, str]:
    """Open MPI's settings shared by every node of a job (a job's ``env`` may override each; mpirun
    passes them on to every rank): the ob1 messaging layer over shared memory and TCP (no fabric
    libraries to probe), no binding of ranks to cores (the agent shares the node with other
    jobs). When the job's nodes meet on loopback (agents on one machine), MPI's TCP and mpirun's
    own wire-up go over it, which Open MPI otherwise leaves out; across hosts Open MPI picks the
    interfaces itself (a job's ``env`` can name them, docs/mpi.md)."""
    env = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_hwloc_base_binding_policy": "none"}
    if on_loopback(master_addr):
        env["OMPI_MCA_btl_tcp_if_include"] = "127.0.0.0/8"
        env["OMPI_MCA_oob_tcp_if_include"] = "127.0.0.0/8"
    return env


def on_loopback(master_addr: str) -> bool:
    return master_addr == "localhost" or master_addr.startswith("127.")


def shm_dir(session: str) -> str:
    """Where a node's ranks keep shared memory when agents share a machine: in memory
    (``/dev/shm``, where Open MPI would put it) under the session's own name; the session
    folder itself where there is no ``/dev/shm``."""
    return os.path.join("/dev/shm", os.path.basename(session)) if os.path.isdir("/dev/shm") else session


def node_env(master_addr: str, session: str, *, daemon: bool) -> dict[str, str]:
    """What one node's mpirun (``daemon`` False) or daemon adds for itself alone, never passed on
    by mpirun (which hands every ``OMPI_*`` variable of its own to all ranks): the daemon's
    session folder, and, where agents share a machine, where this node's ranks keep shared
    memory (``SHM_DIR_VAR``, set as Open MPI's by ``rank_env``): Open MPI names its segments
    in /dev/shm by host, job and local rank, so two agents' ranks would collide."""
    env = {"OMPI_MCA_orte_tmpdir_base": session} if daemon else {}
    if on_loopback(master_addr):
        env[SHM_DIR_VAR] = shm_dir(session)
    return env


def mpirun_command(*, slots: Sequence[int], python: str, worker_argv: Sequence[str], mpirun: str = "mpirun",
                   as_root: bool = False) -> list[str]:
    """Node 0's mpirun for a world of ``sum(slots)`` ranks, ``slots[k]`` on node ``k`` in rank
    order, each rank ``python -m mpi_rank`` ``worker_argv`` (the exit hook's argv). Raises
    ``ValueError`` on an empty world or an interpreter path mpirun could not pass to its shell."""
    if not slots or any(n < 1 for n in slots):
        raise ValueError(f"slots {list(slots)!r}: every node of an MPI world needs at least one process")
    if any(c.isspace() for c in python):
        raise ValueError(f"python {python!r}: mpirun splits its remote shell at spaces; use a path without them")
    hosts = ",".join(f"{host_of(k)}:{n}" for k, n in enumerate(slots))
    return [
        mpirun, *(["--allow-run-as-root"] if as_root else []),
        "-np", str(sum(slots)), "--host", hosts, "--map-by", "slot",
        # our remote shell, called by mpirun itself for every node (no tree of daemons spawning
        # daemons), and daemons that stay in the session their agent started them in
        "--mca", "plm_rsh_agent", f"{python} -m {RSH_MODULE}",
        "--mca", "plm_rsh_no_tree_spawn", "1",
        "--mca", "orte_leave_session_attached", "1",
        "--mca", "orte_keep_fqdn_hostnames", "1",  # else mpirun cuts node<k>.relay.invalid to node<k>
        # each node's daemon takes Open MPI's settings from its own agent's environment
        "--mca", "plm_rsh_pass_environ_mca_params", "0",
        python, "-m", RANK_MODULE, *worker_argv,
    ]


def handoff_path(run_dir: str | Path, node_rank: int) -> Path:
    return Path(run_dir) / MPI_FOLDER / f"daemon-{node_rank}.json"


def handoff_record(host: str, argv: Sequence[str]) -> dict:
    """What ``mpi_rsh`` writes for ``host``: the command line a remote shell would run."""
    return {"node_rank": node_rank_of(host), "command": " ".join(argv).strip()}


def read_handoffs(run_dir: str | Path) -> dict[int, str]:
    """node rank -> daemon command line, of every complete hand-off in ``run_dir`` so far."""
    out = {}
    folder = Path(run_dir) / MPI_FOLDER
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for name in names:
        if name.startswith("daemon-") and name.endswith(".json"):
            try:
                record = json.loads((folder / name).read_text())
            except (OSError, ValueError):
                continue
            out[int(record["node_rank"])] = str(record["command"])
    return out


def rank_env(environ: Mapping[str, str]) -> dict[str, str]:
    """RANK, LOCAL_RANK and ROLE_RANK of this process, from Open MPI's variables; the node's
    other torch.distributed variables (WORLD_SIZE, MASTER_ADDR, ...) are already in ``environ``."""
    try:
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        local = int(environ["OMPI_COMM_WORLD_LOCAL_RANK"])
        size = int(environ["OMPI_COMM_WORLD_SIZE"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not started by Open MPI's mpirun: OMPI_COMM_WORLD_* {exc} missing or not a number") from None
    offset = int(environ.get(RANK_OFFSET_VAR, "0"))
    world = int(environ.get("WORLD_SIZE", str(size)))
    local_size = int(environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if size != world or rank - local != offset or (local_size and local >= local_size):
        raise ValueError(f"Open MPI placed rank {rank} (local rank {local} of world {size}) where the server "
                         f"placed ranks {offset}..{offset + max(local_size, 1) - 1} of world {world}")
    out = {"RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank)}
    if environ.get(SHM_DIR_VAR):
        out["OMPI_MCA_btl_vader_backing_directory"] = environ[SHM_DIR_VAR]
    return out
