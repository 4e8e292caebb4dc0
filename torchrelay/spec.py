"""Job specs, resources, strategies and job states: pure data, no I/O.

Contract:
- ``JobSpec.from_yaml_text`` / ``JobSpec.parse`` accept the fields of ``JobSpec`` (README.md,
  "The job spec", shows them) and refuse anything else with ``InvalidSpec`` naming the field
  and the value; an unknown key, or one that was dropped (``queue``), is refused by name.
- ``JobState`` and ``TRANSITIONS`` are the one table of legal job state changes;
  ``check_transition`` is what the server calls before every change.
- ``parse_memory`` turns "2GiB", "512MB", "1.5G" or an int into bytes.
"""
from __future__ import annotations

import enum
import re
import shlex
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from torchrelay.errors import Conflict, InvalidSpec

# ---------------------------------------------------------------- memory sizes

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "ki": 2**10, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mi": 2**20, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gi": 2**30, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "ti": 2**40, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_memory(value: int | float | str) -> int:
    """Bytes in ``value`` ("2GiB", "512MB", 1024). Raises ``InvalidSpec`` naming it."""
    if isinstance(value, bool):
        raise InvalidSpec(f"memory: {value!r} is not a size; use bytes or e.g. '2GiB', '512MB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise InvalidSpec(f"memory: {value!r} is negative; use a size >= 0")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidSpec(f"memory: {value!r} is not a size; use bytes or e.g. '2GiB', '512MB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_memory(num_bytes: int) -> str:
    """Human form of a byte count, e.g. 2147483648 -> '2.0GiB'."""
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- spec models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Resources(_Strict):
    """Per-worker resources. ``memory`` is bytes once validated."""

    cpu: float = Field(default=1, ge=0)
    gpu: int = Field(default=0, ge=0)
    memory: int = Field(default=0, ge=0, description="bytes; accepts '2GiB' etc.")
    gpu_type: str | None = None
    accelerator: Literal["none", "required", "prefer", "any"] | None = Field(
        default=None, description="none: CPU only; required: GPUs (of gpu_type, else any one type); prefer: "
        "GPUs when the whole gang fits on them now, else CPUs with gpu=0; any: workers of any device in one "
        "job, gpu GPUs each on GPU nodes and none on CPU nodes, a gloo group (docs/heterogeneous.md). "
        "Default: required when gpu or gpu_type is given, else none")

    @model_validator(mode="after")
    def _accelerator_consistent(self) -> "Resources":
        if self.accelerator == "none" and (self.gpu or self.gpu_type):
            raise ValueError(f"accelerator 'none' with gpu={self.gpu}, gpu_type={self.gpu_type!r}; drop the GPU "
                             "request or use accelerator 'required' or 'prefer'")
        return self

    @property
    def accelerator_mode(self) -> str:
        """``accelerator`` with its default resolved: "none", "required", "prefer" or "any"."""
        if self.accelerator is not None:
            return self.accelerator
        return "required" if (self.gpu or self.gpu_type) else "none"

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> int:
        try:
            return parse_memory(value)
        except InvalidSpec as exc:
            raise ValueError(str(exc).removeprefix("memory: ")) from None


class _Balanced(_Strict):
    """``balance: throughput``: each rank's local batch in proportion to its measured samples/s,
    the global batch unchanged (docs/heterogeneous.md). ``balance_every``: steps between
    re-measurements (K); ``balance_threshold``: the least predicted gain in step time that
    moves the shares (the hysteresis; half of it in the window after a move made from a
    window, calibration's or a changed speed's, a window of K/2 steps; a quarter for one move
    on speeds steady over three windows before any changed), and the least relative move of a
    rank's speed that can count as a real change of it."""

    balance: Literal["none", "throughput"] = "none"
    balance_every: int = Field(default=20, ge=1)
    balance_threshold: float = Field(default=0.1, gt=0, lt=1)


class ElasticRange(_Strict):
    """``elastic: {min_workers, max_workers}``: the job's workers may change while it runs; the
    survivors of a failed worker go on without it (docs/elastic.md)."""

    min_workers: int = Field(ge=1)
    max_workers: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "ElasticRange":
        if self.max_workers < self.min_workers:
            raise ValueError(f"max_workers={self.max_workers} is below min_workers={self.min_workers}; "
                             "give max_workers >= min_workers")
        return self


class _Elastic(_Balanced):
    """A data-parallel kind that takes ``elastic``: ddp (``torchrelay.train.elastic``, membership
    epochs), local_sgd and diloco (survivors redo the period since the last sync point, joiners
    enter at a sync point: ``torchrelay.train.elastic_sync``); docs/elastic.md. An elastic job
    splits each step's batch equally among the members of the moment, so ``balance: throughput``
    does not go with ``elastic``."""

    elastic: ElasticRange | None = None

    @model_validator(mode="after")
    def _elastic_unbalanced(self) -> "_Elastic":
        if self.elastic is not None and self.balance != "none":
            raise ValueError(f"balance={self.balance!r} does not go with elastic: an elastic job splits each "
                             "step's global batch equally among the members of the moment; drop balance "
                             "or elastic")
        return self


class DDPStrategy(_Elastic):
    """Gradients all-reduced every step (DistributedDataParallel); with ``elastic``, by
    ``torchrelay.train.elastic`` over membership epochs."""

    kind: Literal["ddp"] = "ddp"


class LocalSGDStrategy(_Elastic):
    """Each replica steps alone; parameters averaged every ``every`` steps."""

    kind: Literal["local_sgd"]
    every: int = Field(default=8, ge=1)
    warmup_steps: int = Field(default=0, ge=0)


class DiLoCoStrategy(_Elastic):
    """Inner optimizer for ``every`` steps, then the averaged delta through outer Nesterov."""

    kind: Literal["diloco"]
    every: int = Field(default=16, ge=1)
    outer_lr: float = Field(default=0.7, gt=0)
    outer_momentum: float = Field(default=0.9, ge=0, lt=1)


class FinalAverageStrategy(_Strict):
    """Replicas train independently and are averaged once at the end (and at checkpoints)."""

    kind: Literal["final_average"]


class ServerOptimizer(_Strict):
    name: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(default=0.01, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)


class ParameterServerStrategy(_Strict):
    """Parameters on ``servers`` processes; workers push gradients and pull parameters."""

    kind: Literal["parameter_server"]
    servers: int = Field(default=1, ge=1)
    mode: Literal["sync", "async", "ssp"] = "sync"
    staleness: int = Field(default=0, ge=0)
    optimizer: ServerOptimizer = ServerOptimizer()
    server_resources: Resources = Resources(cpu=1)

    @model_validator(mode="after")
    def _staleness_only_for_ssp(self) -> "ParameterServerStrategy":
        if self.mode != "ssp" and self.staleness:
            raise ValueError(f"staleness={self.staleness} only applies to mode 'ssp', not {self.mode!r}")
        return self


class PipelineStrategy(_Strict):
    """Model cut into stages; micro-batches pipelined through them."""

    kind: Literal["pipeline"]
    stages: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    microbatches: int = Field(default=8, ge=1)
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    replicas: int = Field(default=1, ge=1)
    data_parallel: Literal["ddp", "fsdp"] = Field(
        default="ddp", description="how the replicas of a stage share it: ddp (each holds the whole stage, "
        "gradients averaged) or fsdp (the stage's parameters, gradients and optimizer state sharded over them)")
    tensor_parallel: int = Field(default=1, ge=1, description="workers per tensor-parallel group inside each "
                                 "stage replica (1: none); needs data_parallel fsdp; workers = stages × replicas × "
                                 "tensor_parallel")

    @model_validator(mode="after")
    def _tensor_parallel_needs_fsdp(self) -> "PipelineStrategy":
        if self.tensor_parallel > 1 and self.data_parallel != "fsdp":
            raise ValueError(f"tensor_parallel={self.tensor_parallel} inside pipeline stages needs "
                             f"data_parallel: fsdp (got {self.data_parallel!r})")
        return self


class FSDPStrategy(_Strict):
    """Parameters, gradients and optimizer state sharded over the workers (FSDP2); optionally tensor
    parallel inside groups of ``tensor_parallel`` workers on a 2-D device mesh (docs/strategies.md)."""

    kind: Literal["fsdp"]
    wrap: Union[Literal["auto"], list[str]] = Field(
        default="auto", description="the units sharded (and gathered) one at a time: class names of "
        "submodules, or auto (each child of a Sequential, else the model's repeated blocks)")
    reshard_after_forward: bool = Field(default=True, description="free each unit's gathered parameters "
                                        "after its forward (gathered again in backward): less memory, more traffic")
    mixed_precision: Literal["none", "bf16", "fp16"] = Field(
        default="none", description="parameters in this dtype for forward and backward; gradients reduced and "
        "optimizer state kept in float32")
    offload_optimizer: bool = Field(default=False, description="keep the sharded parameters, gradients and "
                                    "optimizer state in CPU memory and step there (for GPU workers)")
    tensor_parallel: int = Field(default=1, ge=1, description="workers per tensor-parallel group (1: none)")

    @field_validator("wrap")
    @classmethod
    def _wrap_names(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"wrap={value!r} must be 'auto' or a non-empty list of module class names")
        return value


Strategy = Annotated[
    Union[DDPStrategy, LocalSGDStrategy, DiLoCoStrategy, FinalAverageStrategy,
          ParameterServerStrategy, PipelineStrategy, FSDPStrategy],
    Field(discriminator="kind"),
]
STRATEGY_KINDS = ("ddp", "local_sgd", "diloco", "final_average", "parameter_server", "pipeline", "fsdp")
ELASTIC_KINDS = ("ddp", "local_sgd", "diloco")
# why ``elastic`` makes no sense for the other kinds (the message of a spec that gives it)
NOT_ELASTIC = {
    "final_average": "its replicas agree only at the end, so a survivor would redo the whole run",
    "parameter_server": "the parameters live on its server processes, which a worker's death does not concern",
    "pipeline": "each worker holds a stage of the model, which dies with it",
    "fsdp": "each worker holds a shard of the parameters and optimizer state, which dies with it",
}


class CheckpointPolicy(_Strict):
    every_steps: int = Field(default=0, ge=0, description="0 = only when the script asks")
    keep: int = Field(default=3, ge=1)
    async_: bool = Field(default=False, alias="async")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# the executor a job goes to unless its spec names another (torchrelay.server.executors)
DEFAULT_EXECUTOR = "agents"

# Spec fields that were accepted once and are gone: refused in new specs, dropped from stored ones.
RETIRED_KEYS = frozenset({"queue"})


class JobSpec(_Strict):
    """A job as submitted. ``workers`` is the total; ``nodes`` × ``workers_per_node`` pins the shape."""

    name: str = Field(default="job", min_length=1, max_length=128)
    workdir: str = "."
    entrypoint: str
    workers: int = Field(default=1, ge=1)
    nodes: int | None = Field(default=None, ge=1)
    workers_per_node: int | None = Field(default=None, ge=1)
    resources: Resources = Resources()
    strategy: Strategy = DDPStrategy()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    max_restarts: int = Field(default=0, ge=0)
    priority: int = 0
    env: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    preemptible: bool = True
    max_runtime_s: float | None = Field(default=None, gt=0)
    labels: dict[str, str] = Field(default_factory=dict, description="node labels required")
    hang_timeout_s: float = Field(default=60.0, ge=0, description="restart when no metric arrives for this "
                                  "long after the first one (0: never)")
    stop_grace_s: float = Field(default=30.0, ge=0, description="SIGTERM to SIGKILL when stopping workers")
    executor: str = Field(default=DEFAULT_EXECUTOR, pattern=r"^[a-z][a-z0-9_-]*$", max_length=64,
                          description="what places the job: 'agents' (the server's own nodes) or the name of "
                          "an executor the server was started with, e.g. 'slurm'")
    launcher: Literal["torchrun", "mpirun"] = Field(
        default="torchrun", description="torchrun (a world of one: started directly), or mpirun: one Open MPI "
        "world across the job's nodes (docs/mpi.md)")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, value: str) -> str:
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"entrypoint {value!r} is not a valid command line: {exc}") from None
        if not argv:
            raise ValueError("entrypoint is empty; give the command to run, e.g. 'python train.py'")
        return value

    @field_validator("strategy", mode="before")
    @classmethod
    def _elastic_kind(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("elastic") is not None and value.get("kind") in NOT_ELASTIC:
            kind = value["kind"]
            raise ValueError(f"elastic does not apply to strategy kind {kind!r}: {NOT_ELASTIC[kind]}; it applies "
                             f"to {', '.join(ELASTIC_KINDS)}. Drop elastic (a failed worker then restarts the "
                             "job from its checkpoint, docs/fault-tolerance.md)")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", value):
            raise ValueError(f"name {value!r} must be letters, digits, '_', '.' or '-'")
        return value

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        nodes, per_node = data.get("nodes"), data.get("workers_per_node")
        if nodes is not None and per_node is not None:
            total = nodes * per_node if isinstance(nodes, int) and isinstance(per_node, int) else None
            if "workers" in data and total is not None and data["workers"] != total:
                raise ValueError(f"workers={data['workers']} does not equal nodes × workers_per_node = "
                                 f"{nodes} × {per_node} = {total}; give one or the other")
            if total is not None:
                data = {**data, "workers": total}
        elif (nodes is None) != (per_node is None):
            raise ValueError("nodes and workers_per_node go together; give both or neither")
        return data

    @model_validator(mode="after")
    def _tensor_parallel_divides_workers(self) -> "JobSpec":
        degree = getattr(self.strategy, "tensor_parallel", 1)
        if self.workers % degree:
            raise ValueError(f"strategy.tensor_parallel={degree} must divide workers={self.workers}: the "
                             f"workers form a (data parallel × tensor parallel) mesh; use workers = "
                             f"{degree} × k")
        return self

    @model_validator(mode="after")
    def _elastic_range(self) -> "JobSpec":
        elastic = getattr(self.strategy, "elastic", None)
        if elastic is not None and not elastic.min_workers <= self.workers <= elastic.max_workers:
            raise ValueError(f"workers={self.workers} is outside strategy.elastic's range "
                             f"[{elastic.min_workers}, {elastic.max_workers}]; give workers within it")
        return self

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.entrypoint)

    # ------------------------------------------------------------ parsing at the edge

    @classmethod
    def parse(cls, data: Any) -> "JobSpec":
        """Validate a dict into a spec. Raises ``InvalidSpec`` naming each bad field and value."""
        if not isinstance(data, dict):
            raise InvalidSpec(f"a job spec is a mapping of fields, got {type(data).__name__}: {data!r:.80}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise InvalidSpec(describe_validation_error(exc)) from None

    @classmethod
    def from_stored(cls, data: Any) -> "JobSpec":
        """A spec as a server stored it, perhaps under an older version: keys that were retired
        since (``RETIRED_KEYS``) are dropped, so a data dir kept across an upgrade still loads.
        Raises ``InvalidSpec`` as ``parse`` does for anything else."""
        if isinstance(data, dict) and RETIRED_KEYS.intersection(data):
            data = {k: v for k, v in data.items() if k not in RETIRED_KEYS}
        return cls.parse(data)

    @classmethod
    def from_yaml_text(cls, text: str, overrides: list[str] | None = None) -> "JobSpec":
        """Parse YAML, apply ``--set key.sub=value`` overrides, validate. Raises ``InvalidSpec``."""
        import yaml  # local: keep `spec` importable without YAML for the server's JSON path

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise InvalidSpec(f"the job spec is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidSpec(f"a job spec is a mapping of fields, got {type(data).__name__}")
        for item in overrides or []:
            data = apply_override(data, item)
        return cls.parse(data)

    def to_public(self) -> dict[str, Any]:
        """JSON-ready dict that ``parse`` accepts back (the resolved spec)."""
        return self.model_dump(mode="json", by_alias=True)


def apply_override(data: dict[str, Any], item: str) -> dict[str, Any]:
    """Return ``data`` with ``a.b=value`` set; value parsed as YAML scalar. Raises ``InvalidSpec``."""
    import yaml

    if "=" not in item:
        raise InvalidSpec(f"--set {item!r} is not key=value, e.g. --set workers=4")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise InvalidSpec(f"--set {item!r} has no key before '='")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    out = dict(data)
    node = out
    for part in parts[:-1]:
        child = node.get(part)
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[parts[-1]] = value
    return out


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: 'field.path: message (got value)'."""
    lines = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"]]
        # a discriminated union puts the tag ("ddp") into the path: drop it
        parts = [p for i, p in enumerate(parts) if not (i and parts[i - 1] == "strategy" and p in STRATEGY_KINDS)]
        loc = ".".join(parts) or "spec"
        if err["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key {loc.rsplit('.', 1)[-1]!r} (value {err['input']!r})")
            continue
        if err["type"] == "union_tag_invalid":
            got = err.get("ctx", {}).get("tag")
            lines.append(f"{loc}.kind: unknown strategy {got!r}; expected one of {', '.join(STRATEGY_KINDS)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        shown = "" if isinstance(value, dict) or value is None else f" (got {value!r})"
        lines.append(f"{loc}: {msg}{shown}")
    return "invalid job spec: " + "; ".join(lines)


# ---------------------------------------------------------------- job states


class JobState(str, enum.Enum):
    """Life of a job.

    QUEUED -> SCHEDULED -> RUNNING -> (RESTARTING -> RUNNING)* -> SUCCEEDED | FAILED | CANCELLED,
    with CANCELLING between a cancel request and CANCELLED. A preempted or displaced job goes
    back to QUEUED. The full table is ``TRANSITIONS``.
    """

    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def active(self) -> bool:
        """Holds resources on nodes (launched or about to be)."""
        return self in (JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING)


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})

_S = JobState
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.QUEUED: frozenset({_S.SCHEDULED, _S.CANCELLED, _S.FAILED}),
    _S.SCHEDULED: frozenset({_S.RUNNING, _S.CANCELLING, _S.FAILED, _S.QUEUED, _S.RESTARTING, _S.SUCCEEDED}),
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.RESTARTING, _S.CANCELLING, _S.QUEUED}),
    _S.RESTARTING: frozenset({_S.RUNNING, _S.FAILED, _S.CANCELLING, _S.QUEUED, _S.SUCCEEDED}),
    _S.CANCELLING: frozenset({_S.CANCELLED, _S.SUCCEEDED, _S.FAILED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


def can_transition(current: JobState, target: JobState) -> bool:
    return target in TRANSITIONS[current]


def check_transition(job_id: str, current: JobState, target: JobState) -> None:
    """Raise ``Conflict`` naming the job and both states unless current -> target is legal."""
    _check_in(TRANSITIONS, f"job {job_id}", current, target)


def _check_in(table: dict[Any, frozenset[Any]], what: str, current: enum.Enum, target: enum.Enum) -> None:
    if target not in table[current]:
        allowed = ", ".join(sorted(s.value for s in table[current])) or "none (terminal)"
        raise Conflict(f"{what} cannot go from {current.value} to {target.value}; "
                       f"allowed from {current.value}: {allowed}")


# ---------------------------------------------------------------- launch and node states
# The server's own records beside the job's: like ``TRANSITIONS``, each table is the one list
# of legal changes, and the server checks it before every change it writes.


class LaunchState(str, enum.Enum):
    """Life of one launch (one torchrun, or one worker started directly, on one node).

    PENDING (placed, the agent has not reported it) -> PREPARING (fetching the bundle, starting)
    -> RUNNING -> EXITED; any state but EXITED may go straight to EXITED, and PENDING straight
    to RUNNING. A launch never moves back: an agent's report that would (a resend) is stale.
    The values are the strings the agent reports (``wire.LaunchStatus.state``).
    """

    PENDING = "pending"
    PREPARING = "preparing"
    RUNNING = "running"
    EXITED = "exited"


_L = LaunchState
LAUNCH_TRANSITIONS: dict[LaunchState, frozenset[LaunchState]] = {
    _L.PENDING: frozenset({_L.PREPARING, _L.RUNNING, _L.EXITED}),
    _L.PREPARING: frozenset({_L.RUNNING, _L.EXITED}),
    _L.RUNNING: frozenset({_L.EXITED}),
    _L.EXITED: frozenset(),
}


def can_launch_transition(current: LaunchState, target: LaunchState) -> bool:
    return target in LAUNCH_TRANSITIONS[current]


def check_launch_transition(launch_id: str, current: LaunchState, target: LaunchState) -> None:
    """Raise ``Conflict`` naming the launch and both states unless current -> target is legal."""
    _check_in(LAUNCH_TRANSITIONS, f"launch {launch_id}", current, target)


class NodeState(str, enum.Enum):
    """A node as the server sees it: READY (heartbeats arrive), LOST (they stopped; its launches
    were failed, not counted against the job), DRAINING (gets nothing new). A LOST node that
    heartbeats or registers again is READY. The values are ``wire.NodeInfo.state``'s."""

    READY = "READY"
    LOST = "LOST"
    DRAINING = "DRAINING"


_N = NodeState
NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _N.READY: frozenset({_N.LOST, _N.DRAINING}),
    _N.LOST: frozenset({_N.READY}),
    _N.DRAINING: frozenset({_N.READY, _N.LOST}),
}


def can_node_transition(current: NodeState, target: NodeState) -> bool:
    return target in NODE_TRANSITIONS[current]


def check_node_transition(node_id: str, current: NodeState, target: NodeState) -> None:
    """Raise ``Conflict`` naming the node and both states unless current -> target is legal."""
    _check_in(NODE_TRANSITIONS, f"node {node_id}", current, target)
