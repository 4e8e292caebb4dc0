"""What the Slurm executor submits: a job's shape on a partition, and the batch script. Pure.

- ``SlurmConfig``: one Slurm executor's settings (partition, the shared job folder, the
  interpreter on the nodes, poll interval, the time-limit signal).
- ``parse_sinfo(text, partition)``: ``PartitionLimits`` from ``sinfo -h -N -p P -o SINFO_FORMAT``.
- ``shape_of(spec, limits, hetjob=True)``: the ``SlurmShape`` of a job: its groups (one per
  role: the workers, and a parameter-server job's servers, each nodes × processes per node and
  what each node is asked for). Without ``nodes`` in the spec, the fewest nodes whose even share
  fits one node. A parameter-server job is a heterogeneous job, one component per role with its
  own shape (``hetjob``; else, the fallback, one step whose every process gets the larger of
  the two shapes). Raises ``Unschedulable`` naming the partition's limits when the job can
  never fit (more nodes, CPUs, GPUs or memory than it has, or a runtime over its time limit).
- ``render_batch_script(submission)``: the text given to ``sbatch --parsable`` (what
  ``relay submit --dry-run`` prints): components separated by ``#SBATCH hetjob``, and one
  ``srun`` per group (``--het-group=K``) of one task per node, each running ``python -m
  torchrelay.agent.slurm_step ATTEMPT_DIR [K]`` (the agent's own launcher there). A run after
  Slurm requeued the job (``SLURM_RESTART_COUNT`` above 0) first waits for the server to name
  the attempt it adopted the run as (``requeued_pointer``), and runs that attempt's folder.

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
from torchrelay.spec import JobSpec, ParameterServerStrategy, Resources

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
    hetjob: bool = True  # a parameter-server job's roles as heterogeneous components (else one step)

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
class SlurmGroup:
    """One role's share of a job: ``nodes`` × ``per_node`` processes, each node asked for
    ``cpus`` CPUs, ``gpus`` GPUs and ``memory_mb`` (0: the partition's default) for them together.
    In a heterogeneous job, one component; else the whole job."""

    role: str  # "workers", "servers", or "all" (a parameter-server job in one step)
    nodes: int
    per_node: int
    cpus: int
    gpus: int
    memory_mb: int

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True, slots=True, kw_only=True)
class SlurmShape:
    """A job's shape on Slurm: its ``groups`` in rank order (workers first, then a
    parameter-server job's servers); more than one is a heterogeneous job, one component per
    group. Node ranks and ranks follow the groups' order."""

    groups: tuple[SlurmGroup, ...]
    time_min: int | None = None

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def world(self) -> int:
        return sum(g.world for g in self.groups)

    @property
    def hetjob(self) -> bool:
        return len(self.groups) > 1

    def describe(self) -> str:
        """``2 node(s) × 1`` or ``workers 2 node(s) × 1 + servers 1 node(s) × 1``."""
        if not self.hetjob:
            return f"{self.nodes} node(s) × {self.groups[0].per_node}"
        return " + ".join(f"{g.role} {g.nodes} node(s) × {g.per_node}" for g in self.groups)


def _per_process(spec: JobSpec) -> tuple[float, int, int]:
    """(cpu, gpu, memory bytes) each process of a one-step job gets: Slurm gives every node of a
    job (or of one heterogeneous component) the same, so there a parameter-server job's
    processes all get the larger of its two shapes."""
    res = [spec.resources]
    if isinstance(spec.strategy, ParameterServerStrategy):
        res.append(spec.strategy.server_resources)
    return max(r.cpu for r in res), max(r.gpu for r in res), max(r.memory for r in res)


def _time_min(spec: JobSpec) -> int | None:
    return math.ceil(spec.max_runtime_s / 60) if spec.max_runtime_s else None


def group_shape(role: str, res: tuple[float, int, int], nodes: int, per_node: int) -> SlurmGroup:
    """``nodes`` × ``per_node`` processes of ``res`` (cpu, gpu, memory bytes each), each node
    asked for what its processes need together."""
    cpu, gpu, memory = res
    return SlurmGroup(role=role, nodes=nodes, per_node=per_node, cpus=max(1, math.ceil(cpu * per_node)),
                      gpus=gpu * per_node, memory_mb=math.ceil(memory * per_node / MIB))


def _fits(group: SlurmGroup, node: NodeLimits) -> bool:
    return group.cpus <= node.cpus and group.gpus <= node.gpus and group.memory_mb <= node.memory_mb


def _fewest_nodes(role: str, res: tuple[float, int, int], count: int, nodes: int | None,
                  limits: PartitionLimits | None) -> tuple[SlurmGroup | None, SlurmGroup]:
    """(the group of ``count`` processes on the fewest nodes that fit, or None; the best it could
    ask for, for the message). ``nodes``: that many nodes, no choice. Limits unknown: ``nodes``, else one."""
    options = [nodes] if nodes else [n for n in range(1, count + 1) if count % n == 0]
    candidates = [group_shape(role, res, n, count // n) for n in options]
    if limits is None:
        return candidates[0], candidates[0]
    for group in candidates:
        if sum(1 for node in limits.nodes if _fits(group, node)) >= group.nodes:
            return group, group
    return None, candidates[-1]


def _res(r: Resources) -> tuple[float, int, int]:
    return r.cpu, r.gpu, r.memory


def _never_fits(spec: JobSpec, limits: PartitionLimits | None, what: str) -> Unschedulable:
    runtime = f", max_runtime_s={spec.max_runtime_s:g}" if spec.max_runtime_s else ""
    has = limits.describe() if limits is not None else "the partition's limits are not known yet"
    return Unschedulable(f"job {spec.name!r} can never run on Slurm: it needs {what}{runtime}, but {has}; lower "
                         "`workers`, the per-worker `resources` or `max_runtime_s`, or use another partition")


def _need(count: int, res: tuple[float, int, int], best: SlurmGroup, who: str = "process(es)") -> str:
    cpu, gpu, memory = res
    return (f"{count} {who} × (cpu={cpu:g}, gpu={gpu}, memory={math.ceil(memory / MIB)}MB), at best "
            f"{best.nodes} node(s) × {best.per_node}")


def shape_of(spec: JobSpec, limits: PartitionLimits | None, *, hetjob: bool = True) -> SlurmShape:
    """The job's shape on the partition. A parameter-server job with ``hetjob``: two groups
    (workers: ``nodes`` × ``workers_per_node`` when given, else the fewest nodes that fit; its
    servers: the fewest nodes that fit), else one step. ``limits`` None (not read yet): the
    spec's nodes, else one node per group. Raises ``Unschedulable`` when it can never fit."""
    too_long = (limits is not None and limits.max_time_s is not None and spec.max_runtime_s
                and spec.max_runtime_s > limits.max_time_s)
    ps = spec.strategy if isinstance(spec.strategy, ParameterServerStrategy) else None
    if ps is not None and hetjob:
        workers, w_best = _fewest_nodes("workers", _res(spec.resources), spec.workers, spec.nodes, limits)
        servers, s_best = _fewest_nodes("servers", _res(ps.server_resources), ps.servers, None, limits)
        if workers is not None and servers is not None and not too_long:
            return SlurmShape(groups=(workers, servers), time_min=_time_min(spec))
        raise _never_fits(spec, limits, f"{_need(spec.workers, _res(spec.resources), w_best, 'worker(s)')} and "
                                        f"{_need(ps.servers, _res(ps.server_resources), s_best, 'server(s)')}")
    world = RankLayout.of_spec(spec).world_size
    if spec.nodes and spec.nodes * (spec.workers_per_node or 1) != world:
        raise Unschedulable(f"job {spec.name!r}: nodes={spec.nodes} × workers_per_node={spec.workers_per_node} "
                            f"does not hold its {world} processes (workers and servers) in one Slurm step; on "
                            f"Slurm give `workers` alone, or nodes × workers_per_node = {world}")
    group, best = _fewest_nodes("all" if ps else "workers", _per_process(spec), world, spec.nodes, limits)
    if group is not None and not too_long:
        return SlurmShape(groups=(group,), time_min=_time_min(spec))
    raise _never_fits(spec, limits, _need(world, _per_process(spec), best))


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """One attempt's batch job: what ``render_batch_script`` writes."""

    name: str
    config: SlurmConfig
    shape: SlurmShape
    attempt_dir: str
    extra_env: tuple[tuple[str, str], ...] = field(default=())


_PICK_PORT = 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
ADOPT_WAIT_S = 600  # how long a requeued run waits for the server to name its attempt


def requeued_pointer(attempt_dir: str, restart: int) -> str:
    """The file in the submitting attempt's folder that names the folder of the attempt the
    Slurm job's run after its ``restart``-th requeue is (written by the server, read by the script)."""
    return str(PurePosixPath(attempt_dir) / f"requeued-{restart}")


def _group_options(cfg: SlurmConfig, group: SlurmGroup, time_min: int | None) -> list[str]:
    opts = [f"--partition={cfg.partition}", f"--nodes={group.nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={group.cpus}"]
    if group.gpus:
        opts.append(f"--gres=gpu:{group.gpus}")
    if group.memory_mb:
        opts.append(f"--mem={group.memory_mb}M")
    if time_min:
        opts.append(f"--time={time_min}")
    return opts


def _options(sub: Submission) -> list[str]:
    """The ``#SBATCH`` lines: the job's (and its first component's), then one block per further
    component after ``#SBATCH hetjob``, each with its own shape (the job-wide options of the
    first are Slurm's to propagate; the partition, time limit and extra arguments are repeated)."""
    cfg, shape = sub.config, sub.shape
    first, *rest = shape.groups
    opts = [f"--job-name={sub.name}", f"--output={sub.attempt_dir}/slurm-%j.out", f"--chdir={sub.attempt_dir}",
            "--open-mode=append", *_group_options(cfg, first, shape.time_min)]
    if cfg.signal_s:
        opts.append(f"--signal=B:USR1@{cfg.signal_s}")
    opts.append("--requeue" if cfg.requeue else "--no-requeue")
    opts += list(cfg.sbatch_args)
    lines = [f"#SBATCH {opt}" for opt in opts]
    for group in rest:
        lines.append("#SBATCH hetjob")
        lines += [f"#SBATCH {opt}" for opt in [*_group_options(cfg, group, shape.time_min), *cfg.sbatch_args]]
    return lines


def _adopted_run(attempt_dir: str) -> list[str]:
    """Shell lines setting ``attempt_dir``: this attempt's folder, or, in a run after Slurm
    requeued the job, the folder of the attempt the server adopted the run as (it writes
    ``requeued-N``; the run waits for it, at most ``ADOPT_WAIT_S``)."""
    q = shlex.quote
    return [f"attempt_dir={q(attempt_dir)}",
            "restart=${SLURM_RESTART_COUNT:-0}",
            'if [ "$restart" != 0 ]; then',
            "  # Slurm requeued this job: the server adopts the run as the job's next attempt and names its folder",
            f'  named="$attempt_dir/requeued-$restart"; waited=0',
            '  until [ -s "$named" ]; do',
            f'    if [ "$waited" -ge {ADOPT_WAIT_S} ]; then echo "torchrelay: no attempt named in $named after '
            f'{ADOPT_WAIT_S} s" >&2; exit 1; fi',
            "    sleep 1; waited=$((waited + 1))",
            "  done",
            '  attempt_dir=$(cat "$named")',
            "fi"]


def _steps(sub: Submission) -> list[str]:
    """One ``srun`` per group (``--het-group=K`` in a heterogeneous job), one task per node, each
    the agent's launcher for that node's processes; then wait for all of them."""
    cfg, q = sub.config, shlex.quote
    lines, het = [], sub.shape.hetjob
    for k, group in enumerate(sub.shape.groups):
        where = f"--het-group={k} " if het else ""
        group_arg = f" {k}" if het else ""
        lines += [f"# {group.role}: {group.nodes} node(s) × {group.per_node}",
                  f"srun {where}--ntasks-per-node=1 --kill-on-bad-exit=0 {q(cfg.python)} -m {STEP_MODULE} "
                  f'"$attempt_dir"{group_arg} &',
                  'steps="${steps:-} $!"']
    lines += ["# wait returns early when the trap ran: wait again until each step has ended",
              "status=0",
              "for step in $steps; do",
              '  while :; do wait "$step"; code=$?; kill -0 "$step" 2>/dev/null || break; done',
              '  if [ "$code" != 0 ]; then status=$code; fi',
              "done",
              'exit "$status"', ""]
    return lines


def render_batch_script(sub: Submission) -> str:
    """The batch script of ``sub`` (see the module docstring)."""
    cfg, q = sub.config, shlex.quote
    kind = ("a heterogeneous job: one component per role, " + ", ".join(g.role for g in sub.shape.groups)
            if sub.shape.hetjob else "one step")
    lines = ["#!/bin/bash",
             f"# torchrelay: {sub.name}; written by the server, submitted with sbatch --parsable; {kind}"]
    lines += _options(sub)
    lines += ["set -u", *_adopted_run(sub.attempt_dir),
              "# node 0 (this host) picks the rendezvous port; every task reads it from the environment",
              f"export RELAY_MASTER_PORT=$({q(cfg.python)} -c {q(_PICK_PORT)})"]
    lines += [f"export {key}={q(value)}" for key, value in sub.extra_env]
    lines += ["# Slurm's warning before the time limit reaches this shell alone (B:USR1): every node's launcher",
              "# sees the file and stops its workers as an agent stops them (SIGTERM: checkpoint, then exit)",
              f"trap 'date +%s >> \"$attempt_dir/{STOP_REQUEST}\"' USR1",
              *_steps(sub)]
    return "\n".join(lines)
