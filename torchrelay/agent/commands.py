"""What a launch runs and with what environment: an assignment in, an argv or a mapping out (pure).

Contract:
- ``is_direct(assignment)``: a world of one (one node, one worker) is started without torchrun.
- ``build_torchrun_command``: torchrun with static rendezvous (``--nnodes``, ``--node-rank``,
  ``--nproc-per-node``, ``--master-addr``, ``--master-port``, ``--max-restarts 0``), its own
  files (``--log-dir``: the workers' error files) in the launch's folder, every
  worker under the exit hook (``-m WORKER_MODULE`` and the target's ``worker_argv``); never
  for a launch of joiners of a running elastic job (``RELAY_ELASTIC_JOIN=1``).
- ``direct_command(target, python)``: a hosted script or module as
  ``python -m WORKER_MODULE --no-supervisor ...`` (the exit hook in that one process), code or
  a program as its own command line.
- ``build_worker_env``: the environment of every process of a launch, in layers, each winning
  over the one before: the node's own environment; the node's transports (``node_env``: the
  socket interface of its advertised address and ``RELAY_PS_HOST``, ``netif.transport_env``);
  ``assignment.env`` (what the server built:
  the job's ``env`` and ``RELAY_STRATEGY``, ``RELAY_GPUS_PER_WORKER`` and the like); the
  assignment's identity as ``RELAY_*`` variables (the store's URL and its public options as
  ``RELAY_STORE_OPTIONS``; the store's credentials are the node's own, from its environment); last what only this agent knows (the
  launch's folders, the address it reaches the server at and the CA it trusts there
  (``RELAY_CA``, absolute; none when the agent has none), the GPU indices it picked).
- ``build_rank_env``: what torchrun's local agent adds for one worker, for a direct launch.
Every builder raises ``ValueError`` on a value it cannot use, naming it.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from torchrelay import wire
from torchrelay.tls import CA_ENV, configured_ca
from torchrelay.agent.target import WORKER_MODULE, WorkerTarget, target_of_entrypoint


JOIN_VAR = "RELAY_ELASTIC_JOIN"  # the server's mark on a launch of joiners (torchrelay.server.assignment)


def is_direct(assignment: wire.LaunchAssignment) -> bool:
    """Whether ``assignment`` is a world of one (one node, one worker): started without
    torchrun."""
    return assignment.nnodes == 1 and assignment.nproc_per_node == 1 and assignment.world_size == 1


def _check_rendezvous(master_addr: str, master_port: int, whose: str) -> None:
    if not master_addr:
        raise ValueError(f"master_addr {master_addr!r} is empty; {whose}")
    if not 0 < int(master_port) < 65536:
        raise ValueError(f"master_port {master_port!r} is not a TCP port (1..65535)")


def build_torchrun_command(assignment: wire.LaunchAssignment, *, master_addr: str,
                           master_port: int, log_dir: Path | str, python: str = sys.executable,
                           shutdown_timeout_s: int = 10) -> list[str]:
    """The torchrun argv for ``assignment``; torchrun keeps its files under ``log_dir`` (without
    ``--log-dir`` it makes a ``/tmp/torchelastic_*`` folder per launch and never removes it).
    Raises ``ValueError`` for a launch of joiners
    (``RELAY_ELASTIC_JOIN=1``: a grown elastic job's): torchrun's static rendezvous would wait
    for a world that formed long ago; only the warm launch starts them."""
    if assignment.env.get(JOIN_VAR) == "1":
        raise ValueError(f"launch {assignment.launch_id} starts joiners of a running elastic job "
                         f"({JOIN_VAR}=1): they need the warm launch, torchrun cannot join a running world")
    _check_rendezvous(master_addr, master_port, "node 0's address is needed")
    return [
        python, "-m", "torch.distributed.run",
        "--nnodes", str(assignment.nnodes),
        "--node-rank", str(assignment.node_rank),
        "--nproc-per-node", str(assignment.nproc_per_node),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--max-restarts", "0",
        "--shutdown-timeout", str(int(shutdown_timeout_s)),
        "--log-dir", os.fspath(log_dir),
        "-m", WORKER_MODULE, *target_of_entrypoint(assignment.entrypoint, python).worker_argv(),
    ]


def direct_command(target: WorkerTarget, python: str = sys.executable) -> list[str]:
    """The argv of a direct launch of ``target``."""
    if target.hosted:
        return [python, "-m", WORKER_MODULE, "--no-supervisor", *target.worker_argv()]
    return target.program_argv()


AGENT_SECRETS = frozenset({"RELAY_ENROLL_TOKEN", "RELAY_TOKEN"})


def build_worker_env(assignment: wire.LaunchAssignment, *, base_env: Mapping[str, str],
                     run_dir: Path, relay_address: str, cuda_visible_devices: str | None = None,
                     node_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launch's processes (torchrun passes it on to every worker).

    ``OMP_NUM_THREADS`` defaults to 1 unless ``base_env`` or ``assignment.env`` sets it;
    ``cuda_visible_devices`` (the devices the agent gave this launch, see
    ``torchrelay.agent.gpus``; None: leave the variable as it is) wins over both.
    """
    # never a credential of the agent's own (its enrolment token, a token the operator exported):
    # a job's code runs with this environment
    env = {k: v for k, v in base_env.items() if k not in AGENT_SECRETS}
    env.update(node_env or {})
    env.update(assignment.env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({  # the assignment's identity: a job's env cannot change it
        "RELAY_JOB_ID": assignment.job_id,
        "RELAY_ATTEMPT": str(assignment.attempt),
        "RELAY_LAUNCH_ID": assignment.launch_id,
        "RELAY_STORE_URL": assignment.store_url,
        "RELAY_JOB_STORE_PREFIX": assignment.job_store_prefix,
    })
    if assignment.store_options:  # credentials are never among them: the node's own environment has those
        env["RELAY_STORE_OPTIONS"] = json.dumps(assignment.store_options, sort_keys=True)
    else:
        env.pop("RELAY_STORE_OPTIONS", None)
    env.update({  # what only this agent knows
        "RELAY_ADDRESS": relay_address,
        "RELAY_METRICS_DIR": str(run_dir / "metrics"),
        "RELAY_RANK_STATUS_DIR": str(run_dir / "status"),
        "RELAY_LOG_DIR": str(run_dir / "logs"),
        "RELAY_LAUNCH_DIR": os.path.abspath(run_dir),
        "PYTHONUNBUFFERED": "1",
    })
    ca = configured_ca(env=base_env)  # the CA the agent trusts: workers reach the same server
    if ca:
        env[CA_ENV] = ca
    else:
        env.pop(CA_ENV, None)
    if assignment.worker_token:  # valid for this job's attempt only: what a worker may send the server
        env["RELAY_TOKEN"] = assignment.worker_token
    else:
        env.pop("RELAY_TOKEN", None)  # never a token of the agent's own environment
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def build_rank_env(assignment: wire.LaunchAssignment, *, master_addr: str, master_port: int,
                   rank: int = 0) -> dict[str, str]:
    """The variables torchrun's local agent adds for one worker (torch 2.x,
    ``LocalElasticAgent._start_workers`` with static rendezvous), for a direct launch.

    ``TORCHELASTIC_USE_AGENT_STORE`` is ``False``: there is no torchrun store, so rank 0
    of ``init_process_group("env://")`` hosts the store on ``MASTER_PORT`` itself.
    ``TORCHELASTIC_ERROR_FILE`` is not set: nobody would read it (``@record`` then only logs).
    """
    _check_rendezvous(master_addr, master_port, "give this node's address")
    local_rank = rank - assignment.rank_offset
    if not 0 <= local_rank < assignment.nproc_per_node:
        raise ValueError(f"rank {rank} is not on this node (ranks {assignment.rank_offset}.."
                         f"{assignment.rank_offset + assignment.nproc_per_node - 1})")
    return {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(assignment.node_rank), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(assignment.world_size), "LOCAL_WORLD_SIZE": str(assignment.nproc_per_node),
        "GROUP_WORLD_SIZE": str(assignment.nnodes), "ROLE_WORLD_SIZE": str(assignment.world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(int(master_port)),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",  # what torchrun reports without --rdzv-id, as ours runs it
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    }
