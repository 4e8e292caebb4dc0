"""One Slurm node's part of a job attempt: the agent's own launcher, with files for an outbox.

Usage (what the Slurm executor's batch script runs, one task per node, under ``srun``)::

    python -m torchrelay.agent.slurm_step ATTEMPT_DIR [GROUP]

``ATTEMPT_DIR/launch.json`` (written by the server) holds node 0's ``wire.LaunchAssignment``,
every node's launch id and the job's groups (``{"nodes", "per_node", "env"}`` each, in rank
order: the workers, then a parameter-server job's servers; none: one group of the
assignment's shape). ``GROUP`` (default 0) is the group this task's ``srun`` runs: in a
heterogeneous job, its component (``srun --het-group=GROUP``). This process takes its node's
share from Slurm's environment (``SLURM_NODEID`` is the node's rank in its group's step,
``SLURM_STEP_NUM_NODES`` (else ``SLURM_NNODES``) the group's node count; node 0 is the batch
host, ``SLURM_LAUNCH_NODE_IPADDR`` its address, ``RELAY_MASTER_PORT`` the port the batch script
picked there): its node rank is the group's first plus ``SLURM_NODEID``, its ranks follow the
groups before it. It runs that share with ``launcher.Launch``, exactly as an agent would:
torchrun (or a direct start for a world of one) with the worker exit hook, per-rank logs,
metric files and rank markers in ``ATTEMPT_DIR/node-K/``; the transports are pinned to the
interface this node reaches node 0 through (``netif``), as an agent pins its advertised
address's.

Files it writes in ``ATTEMPT_DIR/node-K/`` besides the launch's own:
- ``records.jsonl``: one line per batch of new records, ``{"logs": [LogRecord...],
  "metrics": [MetricRecord...]}`` (the server tails it as it would an agent's posts);
- ``exit.json`` (atomically, last): ``{"status": LaunchStatus, "signalled": "SIGTERM" |
  "SIGUSR1" | null}``.

Stops: SIGTERM/SIGINT (``scancel``, or torchrelay's own stop), and Slurm's warning before the
time limit (``--signal=B:USR1@N`` to the batch shell, which writes ``ATTEMPT_DIR/stop.request``;
a SIGUSR1 sent to this process counts the same) stop the launch as an agent's stop does:
SIGTERM to the workers, which ``torchrelay.train`` turns into a checkpoint, SIGKILL after the
job's ``stop_grace_s``. The exit record names which it was. Exits 0 when the launch
succeeded, else 1.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

from torchrelay import wire
from torchrelay.agent.launcher import Launch
from torchrelay.agent.netif import interface_env, route_address

SHIP_INTERVAL_S = 0.5
STOP_REQUEST = "stop.request"  # the batch script writes it on ``--signal=B:USR1@N``
_CAUGHT = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGTERM", signal.SIGUSR1: "SIGUSR1"}


def node_assignment(template: wire.LaunchAssignment, launch_ids: list[str], env: dict[str, str],
                    groups: list[dict] | None = None, group: int = 0) -> wire.LaunchAssignment:
    """This node's assignment from node 0's ``template``, the job's ``groups`` (None: one, the
    template's shape), the ``group`` this task runs and Slurm's environment. Raises
    ``ValueError`` naming a variable that is missing or does not match the plan."""
    if groups is None:
        groups = [{"nodes": template.nnodes, "per_node": template.nproc_per_node}]
    if not 0 <= group < len(groups):
        raise ValueError(f"group {group} is not one of the attempt's {len(groups)} group(s)")
    try:
        local = int(env["SLURM_NODEID"])
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env["SLURM_NNODES"])
        master_addr, master_port = env["SLURM_LAUNCH_NODE_IPADDR"], int(env["RELAY_MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"not a Slurm task of a torchrelay batch job: {exc!r} (needs SLURM_NODEID, SLURM_NNODES, "
                         "SLURM_LAUNCH_NODE_IPADDR, RELAY_MASTER_PORT)") from None
    mine = groups[group]
    first_node = sum(g["nodes"] for g in groups[:group])
    first_rank = sum(g["nodes"] * g["per_node"] for g in groups[:group])
    node_rank = first_node + local
    if nnodes != mine["nodes"] or not 0 <= local < nnodes or node_rank >= len(launch_ids):
        raise ValueError(f"SLURM_NNODES={nnodes}, SLURM_NODEID={local}: group {group} of the attempt was planned "
                         f"for {mine['nodes']} node(s)")
    update = {"launch_id": launch_ids[node_rank], "node_rank": node_rank, "nproc_per_node": mine["per_node"],
              "rank_offset": first_rank + local * mine["per_node"], "master_addr": master_addr,
              "master_port": master_port}
    if mine.get("env") is not None:
        update["env"] = mine["env"]
    return template.model_copy(update=update)


def _interface_pins(master_addr: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME and its twins for the interface this node reaches node 0 through, as
    an agent pins its advertised address's (docs/design.md, gloo and host addresses); none on
    one host (loopback), or when no route is known."""
    try:
        return interface_env(route_address(f"//{master_addr}:9"))
    except OSError:
        return {}


def _write_atomic(path: Path, data: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data)
    os.replace(tmp, path)


class _Shipper:
    """Appends the launch's new records to ``records.jsonl``."""

    def __init__(self, launch: Launch, path: Path):
        self.launch, self.path = launch, path

    def ship(self) -> None:
        logs, metrics = self.launch.take_logs(), self.launch.take_metrics()
        if logs or metrics:
            line = json.dumps({"logs": [r.model_dump() for r in logs], "metrics": [r.model_dump() for r in metrics]})
            with open(self.path, "a") as fh:
                fh.write(line + "\n")


def run(attempt_dir: Path, env: dict[str, str], group: int = 0) -> int:
    """Run this node's launch to its end (see the module docstring); the exit status."""
    plan = json.loads((attempt_dir / "launch.json").read_text())
    assignment = node_assignment(wire.LaunchAssignment.model_validate(plan["assignment"]), plan["launch_ids"], env,
                                 plan.get("groups"), group)
    run_dir = attempt_dir / f"node-{assignment.node_rank}"
    run_dir.mkdir(parents=True, exist_ok=True)
    caught: list[str] = []
    wake = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        caught.append(_CAUGHT[signal.Signals(signum)])
        wake.set()

    for signum in _CAUGHT:
        signal.signal(signum, on_signal)
    launch = Launch(assignment, code_dir=Path(plan["code_dir"]), run_dir=run_dir, python=sys.executable,
                    base_env={**env, **_interface_pins(assignment.master_addr or "")})
    shipper = _Shipper(launch, run_dir / "records.jsonl")
    status = None
    if not caught:
        launch.start(assignment.master_addr or "", assignment.master_port or 0)
        while status is None and not caught:
            status = launch.wait(SHIP_INTERVAL_S)
            shipper.ship()
            if (attempt_dir / STOP_REQUEST).exists():  # the batch shell got Slurm's time-limit warning
                caught.append("SIGUSR1")
    if status is None:
        status = launch.stop(assignment.stop_grace_s)
    shipper.ship()
    _write_atomic(run_dir / "exit.json", json.dumps({"status": status.model_dump(), "signalled":
                                                     caught[0] if caught else None}))
    return 0 if status.succeeded else 1


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2) or (len(args) == 2 and not args[1].isdigit()):
        print("usage: python -m torchrelay.agent.slurm_step ATTEMPT_DIR [GROUP]", file=sys.stderr)
        return 2
    return run(Path(args[0]), dict(os.environ), int(args[1]) if len(args) == 2 else 0)


if __name__ == "__main__":
    sys.exit(main())
