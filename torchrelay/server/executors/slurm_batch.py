"""What the Slurm executor submits: a job's shape on a partition, and the batch script. Pure.

- ``SlurmConfig``: one Slurm executor's settings (partition, the shared job folder, the
  interpreter on the nodes, poll interval, the time-limit signal).
- ``parse_sinfo(text, partition)``: ``PartitionLimits`` from ``sinfo -h -N -p P -o SINFO_FORMAT``.
- ``shape_of(spec, limits)``: the ``SlurmShape`` of a job (nodes × processes per node, and what
  each node is asked for). Without ``nodes`` in the spec, the fewest nodes whose even share of the
  world fits one node. Raises ``Unschedulable`` naming the partition's limits when the job can
  never fit (more nodes, CPUs, GPUs or memory than it has, or a runtime over its time limit).
- ``render_batch_script(submission)``: the text given to ``sbatch --parsable`` (what
  ``relay submit --dry-run`` prints): one ``srun`` step of one task per node, each running
  ``python -m torchrelay.agent.slurm_step ATTEMPT_DIR`` (the agent's own launcher there).

No I/O, no clock: ``slurm.py`` runs the commands and writes the files.
"""
from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from torchrelay.errors import Unschedulable
from torchrelay.layout import RankLayout
from torchrelay.spec import JobSpec, ParameterServerStrategy

SINFO_FORMAT = "%N|%c|%m|%G|%l|%T"
MIB = 1024 * 1024
STEP_MODULE = "torchrelay.agent.slurm_step"  # what each node runs (the agent's launcher)
STOP_REQUEST = "stop.request"  # written in the attempt folder on Slurm's time-limit warning


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmConfig:
    """One Slurm executor. ``job_root``: a folder every Slurm node sees at the same path (the
    job folders: code, batch scripts, logs, exit records); ``python``: the interpreter on the
    nodes (with torchrelay installed); ``signal_s``: ``--signal=USR1@N`` (0: none)."""

    name: str = "slurm"
    partition: str
    job_root: str
    python: str
    poll_interval_s: float = 10.0
    file_interval_s: float = 1.0
    signal_s: int = 90
    requeue: bool = True
    sbatch_args: tuple[str, ...] = ()
    accounting: bool = False  # sacct answers (else the job-completion log, if it is readable)
    jobcomp_path: str | None = None
    cluster_id: str = "relay"  # prefixes Slurm job names: which server's jobs these are

    def attempt_dir(self, job_id: str, attempt: int) -> str:
        return str(PurePosixPath(self.job_root) / job_id / f"a{attempt}")

    def code_dir(self, job_id: str) -> str:
        return str(PurePosixPath(self.job_root) / job_id / "code")

    def slurm_name(self, job_id: str, attempt: int) -> str:
        return f"{self.cluster_id}-{job_id}-a{attempt}"


@dataclass(frozen=True, slots=True)
class NodeLimits:
    name: str
    cpus: int
    memory_mb: int
    gpus: int
    state: str


@dataclass(frozen=True, slots=True)
class PartitionLimits:
    """A partition's nodes and time limit (None: infinite)."""

    partition: str
    nodes: tuple[NodeLimits, ...]
    max_time_s: float | None = None

    def describe(self) -> str:
        kinds = sorted({(n.cpus, n.gpus, n.memory_mb) for n in self.nodes})
        shapes = "; ".join(f"cpus={c}, gpus={g}, memory={m}MB" for c, g, m in kinds) or "none"
        limit = "infinite" if self.max_time_s is None else f"{self.max_time_s:g}s"
        return (f"partition {self.partition!r} has {len(self.nodes)} node(s) ({shapes}), "
                f"time limit {limit}")


def _gpus_of_gres(gres: str) -> int:
    """GPUs in a ``%G`` field such as ``gpu:4``, ``gpu:a100:2(S:0-1)``, ``(null)``."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_time_limit(text: str) -> float | None:
    """Seconds of a Slurm time limit (``infinite``, ``30``, ``1:00:00``, ``2-12:00:00``); None
    for infinite. Raises ``ValueError`` on anything else."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days = 0
    if "-" in text:
        head, text = text.split("-", 1)
        days = int(head)
    parts = [int(p) for p in text.split(":")]
    if len(parts) == 1:  # minutes
        return float(days * 86400 + parts[0] * 60)
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return float(days * 86400 + h * 3600 + m * 60 + s)


def parse_sinfo(text: str, partition: str) -> PartitionLimits:
    """``sinfo -h -N -p P -o SINFO_FORMAT`` output as limits (a node listed twice counts once)."""
    nodes: dict[str, NodeLimits] = {}
    limit: float | None = None
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        name, cpus, memory, gres, time_limit, state = fields
        nodes[name] = NodeLimits(name=name, cpus=int(cpus), memory_mb=int(memory), gpus=_gpus_of_gres(gres),
                                 state=state)
        limit = parse_time_limit(time_limit)
    return PartitionLimits(partition=partition, nodes=tuple(nodes[n] for n in sorted(nodes)), max_time_s=limit)


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmShape:
    """``nodes`` × ``per_node`` processes; each node asked for ``cpus`` CPUs, ``gpus`` GPUs and
    ``memory_mb`` (0: the partition's default) for its processes together."""

    nodes: int
    per_node: int
    cpus: int
    gpus: int
    memory_mb: int
    time_min: int | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


def _per_process(spec: JobSpec) -> tuple[float, int, int]:
    """(cpu, gpu, memory bytes) each process gets: Slurm gives every node of a job the same,
    so a parameter-server job's processes all get the larger of its two shapes."""
    res = [spec.resources]
    if isinstance(spec.strategy, ParameterServerStrategy):
        res.append(spec.strategy.server_resources)
    return max(r.cpu for r in res), max(r.gpu for r in res), max(r.memory for r in res)


def node_shape(spec: JobSpec, nodes: int, per_node: int) -> SlurmShape:
    """``nodes`` × ``per_node`` of ``spec``'s processes, each node asked for what they need together."""
    cpu, gpu, memory = _per_process(spec)
    time_min = math.ceil(spec.max_runtime_s / 60) if spec.max_runtime_s else None
    return SlurmShape(nodes=nodes, per_node=per_node, cpus=max(1, math.ceil(cpu * per_node)), gpus=gpu * per_node,
                      memory_mb=math.ceil(memory * per_node / MIB), time_min=time_min)


def _fits(shape: SlurmShape, node: NodeLimits) -> bool:
    return shape.cpus <= node.cpus and shape.gpus <= node.gpus and shape.memory_mb <= node.memory_mb


def shape_of(spec: JobSpec, limits: PartitionLimits) -> SlurmShape:
    """The job's shape on the partition. Raises ``Unschedulable`` when it can never fit."""
    world = RankLayout.of_spec(spec).world_size
    if spec.nodes:
        if spec.nodes * (spec.workers_per_node or 1) != world:
            raise Unschedulable(f"job {spec.name!r}: nodes={spec.nodes} × workers_per_node={spec.workers_per_node} "
                                f"does not hold its {world} processes (workers and servers); on Slurm give "
                                f"`workers` alone, or nodes × workers_per_node = {world}")
        candidates = [node_shape(spec, spec.nodes, world // spec.nodes)]
    else:
        candidates = [node_shape(spec, n, world // n) for n in range(1, world + 1) if world % n == 0]
    for shape in candidates:
        hosts = sum(1 for node in limits.nodes if _fits(shape, node))
        too_long = limits.max_time_s is not None and spec.max_runtime_s and spec.max_runtime_s > limits.max_time_s
        if hosts >= shape.nodes and not too_long:
            return shape
    wanted = candidates[0] if spec.nodes else candidates[-1]
    cpu, gpu, memory = _per_process(spec)
    runtime = f", max_runtime_s={spec.max_runtime_s:g}" if spec.max_runtime_s else ""
    raise Unschedulable(f"job {spec.name!r} can never run on Slurm: it needs {world} process(es) × (cpu={cpu:g}, "
                        f"gpu={gpu}, memory={math.ceil(memory / MIB)}MB){runtime}, at best {wanted.nodes} node(s) × "
                        f"{wanted.per_node}, but {limits.describe()}; lower `workers`, the per-worker `resources` "
                        "or `max_runtime_s`, or use another partition")


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """One attempt's batch job: what ``render_batch_script`` writes."""

    name: str
    config: SlurmConfig
    shape: SlurmShape
    attempt_dir: str
    extra_env: tuple[tuple[str, str], ...] = field(default=())


_PICK_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'


def render_batch_script(sub: Submission) -> str:
    """The batch script of ``sub`` (see the module docstring)."""
    cfg, shape, q = sub.config, sub.shape, shlex.quote
    opts = [f"--job-name={sub.name}", f"--partition={cfg.partition}", f"--nodes={shape.nodes}",
            "--ntasks-per-node=1", f"--cpus-per-task={shape.cpus}", f"--output={sub.attempt_dir}/slurm-%j.out",
            f"--chdir={sub.attempt_dir}", "--open-mode=append"]
    if shape.gpus:
        opts.append(f"--gres=gpu:{shape.gpus}")
    if shape.memory_mb:
        opts.append(f"--mem={shape.memory_mb}M")
    if shape.time_min:
        opts.append(f"--time={shape.time_min}")
    if cfg.signal_s:
        opts.append(f"--signal=B:USR1@{cfg.signal_s}")
    opts.append("--requeue" if cfg.requeue else "--no-requeue")
    opts += list(cfg.sbatch_args)
    lines = ["#!/bin/bash", f"# torchrelay: {sub.name}; written by the server, submitted with sbatch --parsable"]
    lines += [f"#SBATCH {opt}" for opt in opts]
    stop_file = q(f"{sub.attempt_dir}/{STOP_REQUEST}")
    lines += ["set -u",
              "# node 0 (this host) picks the rendezvous port; every task reads it from the environment",
              f"export RELAY_MASTER_PORT=$({q(cfg.python)} -c {q(_PICK_PORT)})"]
    lines += [f"export {key}={q(value)}" for key, value in sub.extra_env]
    lines += ["# Slurm's warning before the time limit reaches this shell alone (B:USR1): every node's launcher",
              "# sees the file and stops its workers as an agent stops them (SIGTERM: checkpoint, then exit)",
              f"trap 'date +%s >> {stop_file}' USR1",
              "# one task per node, each the agent's launcher for that node's processes",
              f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 {q(cfg.python)} -m {STEP_MODULE} "
              f"{q(sub.attempt_dir)} &",
              "step=$!",
              "# wait returns early when the trap ran: wait again until the step has ended",
              'while :; do wait "$step"; status=$?; kill -0 "$step" 2>/dev/null || break; done',
              'exit "$status"', ""]
    return "\n".join(lines)
