"""Wire models of the HTTP API under ``/api/v1``: pure pydantic, shared by server, agent, client.

Endpoints (all JSON unless noted; errors are ``{"error": ClassName, "detail": message}``
with the status of ``torchrelay.errors``):

Clients
  POST   /bundles                      body: raw tar.gz bytes        -> BundleRef (idempotent by sha256)
  HEAD   /bundles/{digest}             200 if stored, 404 otherwise
  GET    /bundles/{digest}             -> raw tar.gz bytes
  POST   /jobs                         SubmitRequest                 -> JobInfo (201)
  GET    /jobs?state=&limit=           -> list[JobInfo] (newest first)
  GET    /jobs/{id}                    -> JobInfo
  POST   /jobs/{id}/cancel             -> JobInfo (idempotent)
  GET    /jobs/{id}/logs?after=&rank=&wait= -> LogPage (long-polls up to `wait` s for new lines)
  GET    /jobs/{id}/metrics?after=&wait=    -> MetricPage
  GET    /jobs/{id}/artifacts          -> list[ArtifactInfo]
  GET    /jobs/{id}/artifacts/{path}   -> raw bytes
  GET    /nodes                        -> list[NodeInfo]
  GET    /jobs/{id}/logs/stream?rank=  text/event-stream of log lines (SSE, Last-Event-ID resumes)
  GET    /jobs/{id}/metrics/stream     text/event-stream of metric points
  GET    /jobs/{id}/events/stream      text/event-stream of the job's events
  GET    /events/stream                text/event-stream of every job's events
  GET    /jobs/{id}/series?keys=&points=&start=&end=  -> downsampled metric series (SeriesPage)
  GET    /jobs/{id}/checkpoints        -> list[ArtifactInfo] (files of the job's checkpoints)
  GET    /jobs/{id}/checkpoints/{path} -> raw bytes
  POST   /jobs/{id}/tensorboard        -> list[str] (writes the job's TensorBoard files among its artifacts)
  Outside /api/v1: GET / (the dashboard), GET /metrics (Prometheus text format)
  GET    /health                       -> {"ok": true, "version": ...}

Agents
  POST   /nodes/register               NodeRegistration              -> RegisterReply
  POST   /nodes/{id}/heartbeat         Heartbeat                     -> HeartbeatReply
         Long-poll: answers at once when the desired launches differ from what the agent
         reported, otherwise waits up to ``Heartbeat.wait_s`` for a change.
  POST   /jobs/{id}/logs               LogBatch                      -> {"ok": true}
  POST   /jobs/{id}/metrics            MetricBatch                   -> {"ok": true}
  POST   /jobs/{id}/checkpoints        CheckpointCommit (a worker's) -> {"ok": true, "added": bool}
  PUT    /jobs/{id}/artifacts/{path}   raw bytes                     -> ArtifactInfo

The agent side is declarative: the heartbeat reply lists every launch the server wants on
that node (``LaunchAssignment``, with ``desired`` = "run" or "stop"); the agent makes it so
and reports each launch's status changes in its next heartbeat (``Heartbeat.statuses``), the one
path statuses take (a heartbeat with ``wait_s=0`` carries them while a long poll is open). Re-sending a status
or a log/metric batch with the same sequence numbers is harmless (idempotent by
``(launch_id, rank, seq)``).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from torchrelay.spec import JobState

API_PREFIX = "/api/v1"
# the node label of an agent that can run mpirun jobs (Open MPI found there); an mpirun job
# asks for it, so the scheduler places it only on such nodes (docs/mpi.md)
MPIRUN_LABEL = ("relay.mpirun", "yes")


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- bundles and jobs


class BundleRef(_Model):
    digest: str = Field(description="sha256 hex of the tar.gz bytes")
    size: int


class SubmitRequest(_Model):
    spec: dict[str, Any] = Field(description="a JobSpec as JSON; validated by the server")
    bundle: str | None = Field(default=None, description="digest of an uploaded workdir bundle")


class RankExit(_Model):
    """How one rank ended. ``returned`` is true when its script returned successfully
    (the launcher's exit hook saw it), whatever the process did during teardown."""

    rank: int
    exit_code: int | None = None
    signal: int | None = None
    returned: bool = False
    last_lines: list[str] = Field(default_factory=list)
    reason: str | None = Field(default=None, description="why the node ended it, when it did: e.g. "
                               "'memory limit 1 GiB exceeded' (the kernel's OOM killer in the launch's cgroup)")


class FailureInfo(_Model):
    """Why an attempt (or the job) failed: the first failing rank, as far as known."""

    reason: str
    rank: int | None = None
    node: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    last_lines: list[str] = Field(default_factory=list)
    attempt: int | None = None


class PlacementInfo(_Model):
    node_id: str
    node_name: str
    node_rank: int
    workers: int


class JobEvent(_Model):
    time: float
    state: JobState
    message: str = ""


class EventRecord(_Model):
    """A job event as the event streams carry it: ``id`` is the event row's own, increasing."""

    id: int
    job_id: str
    job_name: str
    time: float
    state: JobState
    message: str = ""


class JobInfo(_Model):
    id: str
    name: str
    user: str | None = None
    state: JobState
    spec: dict[str, Any]
    bundle: str | None = None
    priority: int = 0
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int = 0
    restarts: int = 0
    placement: list[PlacementInfo] = Field(default_factory=list)
    failure: FailureInfo | None = None
    restart_reasons: list[FailureInfo] = Field(default_factory=list)
    waiting_reason: str | None = None
    last_metrics: dict[str, Any] = Field(default_factory=dict)
    events: list[JobEvent] = Field(default_factory=list)


class LogLine(_Model):
    seq: int = Field(description="server-assigned, increasing per job")
    rank: int
    attempt: int = 0
    stream: Literal["stdout", "stderr"] = "stdout"
    text: str


class LogPage(_Model):
    lines: list[LogLine]
    next_after: int = Field(description="pass as `after` to get only newer lines")
    job_state: JobState


class MetricPoint(_Model):
    seq: int = 0
    rank: int
    step: int
    time: float
    values: dict[str, float]


class MetricPage(_Model):
    points: list[MetricPoint]
    next_after: int
    job_state: JobState


class Series(_Model):
    """One metric of one rank, x = step; ``total`` is how many points the full series has
    (``len(x)`` is fewer when downsampled). Non-finite values are null."""

    key: str
    rank: int
    total: int
    x: list[int]
    y: list[float | None]


class SeriesPage(_Model):
    after: int = Field(description="the last metric point included: a metrics stream started here continues it")
    job_state: JobState
    keys: list[str] = Field(description="every metric key the job reported")
    ranks: list[int] = Field(description="every rank that reported")
    series: list[Series]


class ArtifactInfo(_Model):
    path: str
    size: int


# ---------------------------------------------------------------- nodes and agents


class NodeRegistration(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[^\x00-\x1f\x7f]+$")
    address: str = Field(max_length=253, pattern=r"^[^\x00-\x20\x7f/]*$",
                         description="host other nodes reach this node's workers at (empty: an executor's "
                         "own node, e.g. a Slurm partition)")
    cpus: float = Field(ge=0, le=1 << 20)
    gpus: int = Field(default=0, ge=0, le=1 << 16)
    gpu_type: str | None = Field(default=None, max_length=200)
    memory: int = Field(ge=0, le=(1 << 63) - 1, description="bytes")
    labels: dict[str, str] = Field(default_factory=dict)
    node_id: str | None = Field(default=None, max_length=200, description="set when re-registering after a restart")
    probe_port: int | None = Field(default=None, ge=1, le=65535,
                                   description="where the agent's reach probe listens on address "
                                   "(the server connects before calling the node ready)")
    probe_token: str | None = Field(default=None, max_length=200, description="what the probe answers with")


def reach_greeting(token: str) -> bytes:
    """What an agent's reach probe answers a connection with (``NodeRegistration.probe_token``)."""
    return f"torchrelay-agent {token}\n".encode()


class RegisterReply(_Model):
    node_id: str
    heartbeat_timeout_s: float
    credential: str | None = Field(default=None, description="the node's own credential, given once at its "
                                   "enrolment (the agent keeps it and sends it from then on)")


class NodeInfo(_Model):
    id: str
    name: str
    address: str
    state: Literal["READY", "LOST", "DRAINING"]
    cpus: float
    gpus: int
    gpu_type: str | None = None
    memory: int
    labels: dict[str, str] = Field(default_factory=dict)
    used_cpus: float = 0
    used_gpus: int = 0
    used_memory: int = 0
    last_seen: float
    launches: list[str] = Field(default_factory=list, description="launch ids placed here")
    note: str | None = Field(default=None, description="what the node's executor last said of it (Slurm: "
                             "whether slurmctld answers)")
    problem: str | None = Field(default=None, description="why no job is placed here although the node is READY "
                                "(e.g. its address cannot be reached)")


class LaunchReport(_Model):
    """What the agent has for one launch right now (sent with every heartbeat)."""

    launch_id: str
    state: Literal["preparing", "running", "exited"]


class LaunchStatus(_Model):
    """Agent -> server: a launch's actual state. ``master_port`` is sent by node 0 once chosen;
    ``mpi_daemons`` by node 0 of an mpirun job with its ``running``: node rank -> the command line
    of the Open MPI daemon that node must run (docs/mpi.md)."""

    state: Literal["preparing", "running", "exited"]
    master_port: int | None = None
    mpi_daemons: dict[int, str] = Field(default_factory=dict)
    ranks: list[RankExit] = Field(default_factory=list, description="set when exited")
    succeeded: bool | None = Field(default=None, description="set when exited")
    stopped: bool = Field(default=False, description="exited because the server asked it to stop")
    message: str = ""


class LaunchStatusReport(_Model):
    """One status change of one launch, carried in a heartbeat (``Heartbeat.statuses``)."""

    launch_id: str
    status: LaunchStatus


class Heartbeat(_Model):
    launches: list[LaunchReport] = Field(default_factory=list)
    wait_s: float = Field(default=0.0, ge=0, le=60)
    known_version: int = Field(default=-1, description="version of the last reply the agent acted on")
    statuses: list[LaunchStatusReport] = Field(
        default_factory=list, description="status changes not yet delivered, oldest first; applied in order before "
        "the reply is built; a status sent again is applied once")


class MpiWorld(_Model):
    """What the launches of an mpirun job learn of its one MPI world: ``slots`` (processes per
    node, by node rank: node 0's mpirun lists the hosts with them) and, once node 0's mpirun
    handed them over, ``daemons`` (node rank -> the Open MPI daemon command line to run there)."""

    slots: list[int]
    daemons: dict[int, str] = Field(default_factory=dict)


class LaunchAssignment(_Model):
    """One launch of one job attempt on this node: torchrun, or for a world of one (one node,
    one worker) the worker started directly by the agent with the same RANK etc. variables.

    Environment the agent gives the workers (besides torchrun's own RANK etc.):
    RELAY_JOB_ID, RELAY_LAUNCH_ID, RELAY_LAUNCH_DIR (together they identify the launch's
    processes), RELAY_ATTEMPT, RELAY_ADDRESS, RELAY_STORE_URL, RELAY_STORE_OPTIONS (JSON, when the
    store has public options), RELAY_JOB_STORE_PREFIX,
    RELAY_METRICS_DIR, RELAY_STRATEGY (JSON), RELAY_CHECKPOINT (JSON), RELAY_ACCELERATOR
    (``gpu`` or ``cpu``: what the scheduler granted), RELAY_GPUS_PER_WORKER, RELAY_GPU_TYPE,
    and ``env``.
    """

    launch_id: str
    job_id: str
    attempt: int
    desired: Literal["run", "stop"]
    stop_reason: str | None = None
    node_rank: int
    nnodes: int
    nproc_per_node: int
    world_size: int
    rank_offset: int = Field(description="global rank of this node's local rank 0")
    master_addr: str | None = Field(default=None, description="None until node 0 reported its port")
    master_port: int | None = None
    entrypoint: list[str]
    bundle: str | None
    env: dict[str, str] = Field(default_factory=dict)
    store_url: str
    store_options: dict[str, str] = Field(
        default_factory=dict, description="where the store is besides its URL (endpoint_url, region, "
        "addressing_style); never a credential: workers use their own (environment, ~/.aws)")
    job_store_prefix: str
    stop_grace_s: float = Field(default=30.0, description="SIGTERM, then SIGKILL after this long")
    cpu: float = Field(default=0.0, ge=0, description="cpus granted per worker (the launch's cgroup weight)")
    memory: int = Field(default=0, ge=0, description="bytes granted per worker (the launch's cgroup limit; 0: none)")
    launcher: Literal["torchrun", "mpirun"] = "torchrun"
    mpi: MpiWorld | None = Field(default=None, description="set for an mpirun job (``launcher``)")
    worker_token: str | None = Field(default=None, description="the workers' RELAY_TOKEN: valid for this job's "
                                     "attempt only")
    released_ranks: list[int] = Field(default_factory=list, description="an elastic launch's global ranks the server "
                                      "asked to leave (a shrink): the agent ends those ranks only (SIGTERM, "
                                      "SIGKILL after stop_grace_s); the others go on")


class HeartbeatReply(_Model):
    version: int
    node_state: Literal["READY", "LOST", "DRAINING"]
    launches: list[LaunchAssignment]
    statuses_taken: int = Field(default=0, description="how many of the heartbeat's ``statuses`` the server "
                                "took (applied, or skipped as unknown), in order; the rest are sent again")


class LogRecord(_Model):
    rank: int
    attempt: int = 0
    stream: Literal["stdout", "stderr"] = "stdout"
    seq: int = Field(description="agent-side sequence per (launch, rank, stream): dedups resends")
    text: str


class LogBatch(_Model):
    launch_id: str
    records: list[LogRecord]


class MetricRecord(_Model):
    rank: int
    seq: int = Field(description="line number in the rank's metrics file: dedups resends")
    step: int
    time: float
    values: dict[str, float]


class MetricBatch(_Model):
    launch_id: str
    records: list[MetricRecord]


class CheckpointCommit(_Model):
    """A checkpoint the job's workers committed (rank 0 posts it with its ``RELAY_TOKEN``; the
    attempt is the token's). Posting one again is harmless (idempotent by job, attempt, step, url)."""

    step: int
    url: str = Field(description="where the checkpoint's folder lies, as the workers wrote it")
