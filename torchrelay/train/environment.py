"""What a worker's environment says: who it is, its strategy and checkpoint policy. Pure.

Contract:
- ``context_from_env(env)`` reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``) and torchrelay's (``RELAY_JOB_ID``, ``RELAY_ATTEMPT``, ``RELAY_STRATEGY``,
  ``RELAY_CHECKPOINT``) into a ``Context`` without touching devices or sockets. Missing variables
  mean "one process, no job": rank 0 of a world of 1, DDP. Malformed ones raise ``InvalidSpec``
  naming the variable and its value.
- ``parse_strategy`` is the one reader of ``RELAY_STRATEGY``; ``validate_strategy`` the one
  validator of a strategy given as a dict (both give the spec's models, ``torchrelay.spec``).
- ``choose_backend`` and ``collective_timeout`` decide the process group's backend, device and
  timeout from numbers passed in.

Imports no other module of ``torchrelay.train``: everything else reads the ``Context`` from here.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Mapping

import torch
from pydantic import TypeAdapter, ValidationError

from torchrelay.errors import InvalidSpec
from torchrelay.spec import CheckpointPolicy, DDPStrategy, Strategy, describe_validation_error

_STRATEGY_ADAPTER: TypeAdapter = TypeAdapter(Strategy)


@dataclasses.dataclass
class Context:
    """This worker's place in the job. ``device`` is set by ``init()`` (cpu before it)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    job_id: str | None = None
    attempt: int = 0
    strategy: Strategy = dataclasses.field(default_factory=DDPStrategy)  # the spec's validated model
    checkpoint: CheckpointPolicy = dataclasses.field(default_factory=CheckpointPolicy)
    distributed: bool = False

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that writes shared checkpoints and prints summaries."""
        return self.rank == 0


def _int_var(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidSpec(f"environment variable {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise InvalidSpec(f"environment variable {name}={raw!r} must be >= {minimum}")
    return value


def validate_strategy(data: Any) -> Strategy:
    """``data`` (a job spec's ``strategy`` mapping, or already a model) as the spec's strategy model.

    Raises pydantic's ``ValidationError``; callers word it for where the value came from."""
    return _STRATEGY_ADAPTER.validate_python(data)


def parse_strategy(raw: str | None) -> Strategy:
    """The validated strategy model of ``RELAY_STRATEGY`` JSON; DDP when unset. Raises ``InvalidSpec``."""
    if raw is None or raw.strip() == "":
        return DDPStrategy()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"RELAY_STRATEGY={raw!r} is not JSON ({exc.msg}); "
                          'expected e.g. {"kind": "ddp"}') from None
    try:
        return validate_strategy(data)
    except ValidationError as exc:
        detail = describe_validation_error(exc).removeprefix("invalid job spec: ")
        raise InvalidSpec(f"RELAY_STRATEGY={raw!r} is not a valid strategy: {detail}") from None


def parse_checkpoint_policy(raw: str | None) -> CheckpointPolicy:
    """The validated ``RELAY_CHECKPOINT`` JSON; defaults when unset. Raises ``InvalidSpec``."""
    if raw is None or raw.strip() == "":
        return CheckpointPolicy()
    try:
        return CheckpointPolicy.model_validate(json.loads(raw))
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"RELAY_CHECKPOINT={raw!r} is not JSON ({exc.msg}); "
                          'expected e.g. {"every_steps": 100, "keep": 3}') from None
    except ValidationError as exc:
        detail = describe_validation_error(exc).removeprefix("invalid job spec: ")
        raise InvalidSpec(f"RELAY_CHECKPOINT={raw!r} is not a valid checkpoint policy: {detail}") from None


def context_from_env(env: Mapping[str, str]) -> Context:
    """A ``Context`` for ``env`` (no I/O; device left as cpu). Raises ``InvalidSpec`` on bad values."""
    world_size = _int_var(env, "WORLD_SIZE", 1, minimum=1)
    rank = _int_var(env, "RANK", 0)
    if rank >= world_size:
        raise InvalidSpec(f"environment variable RANK={rank} must be below WORLD_SIZE={world_size}")
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", 1 if "WORLD_SIZE" not in env else world_size, minimum=1)
    local_rank = _int_var(env, "LOCAL_RANK", rank if local_world_size == world_size else 0)
    if local_rank >= local_world_size:
        raise InvalidSpec(f"environment variable LOCAL_RANK={local_rank} must be below "
                          f"LOCAL_WORLD_SIZE={local_world_size}")
    attempt_var = "RELAY_ATTEMPT" if env.get("RELAY_ATTEMPT") else "TORCHELASTIC_RESTART_COUNT"
    return Context(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        job_id=env.get("RELAY_JOB_ID") or None,
        attempt=_int_var(env, attempt_var, 0),
        strategy=parse_strategy(env.get("RELAY_STRATEGY")),
        checkpoint=parse_checkpoint_policy(env.get("RELAY_CHECKPOINT")),
    )


def choose_backend(requested: str | None, cuda_devices: int, local_rank: int,
                   parameter_server: bool = False, mixed_devices: bool = False) -> tuple[str, str]:
    """(backend, device string) for a worker. Pure. Raises ``InvalidSpec`` for an unusable request.

    Under ``parameter_server`` the job's process group is gloo on every rank by default: its
    servers run on CPUs (often on CPU nodes, with their own resources) and every rank must
    build the same backend; gradients and parameters travel over the parameter server's own
    transport, not the group. A worker with a GPU still trains on it.

    Under ``mixed_devices`` (a job of accelerator "any": ``RELAY_MIXED_DEVICES=1``) some ranks
    have a GPU and some do not, so the group is gloo on every rank (nccl cannot reach a CPU
    rank) and each rank trains on its own device: ``cuda:<local_rank>`` when it sees one."""
    if requested is not None and requested not in ("gloo", "nccl", "mpi"):
        raise InvalidSpec(f"backend={requested!r} is not one of 'gloo', 'nccl', 'mpi'")
    on_gpu = cuda_devices > 0 and local_rank < cuda_devices
    if requested == "nccl" and not on_gpu:
        raise InvalidSpec(f"backend='nccl' needs a CUDA device for LOCAL_RANK={local_rank}, "
                          f"but {cuda_devices} are visible; use backend='gloo'")
    if mixed_devices and requested not in (None, "gloo"):
        raise InvalidSpec(f"backend={requested!r} in a job of accelerator 'any': its CPU and GPU ranks share "
                          f"one group, which only gloo can build; use backend='gloo' or leave it unset")
    if (parameter_server and requested is None) or mixed_devices:
        return "gloo", (f"cuda:{local_rank}" if on_gpu else "cpu")
    backend = requested or ("nccl" if on_gpu else "gloo")
    device = f"cuda:{local_rank}" if on_gpu and backend == "nccl" else "cpu"
    return backend, device


def collective_timeout(timeout_s: float | None, env_value: str | None) -> datetime.timedelta | None:
    """The process group's timeout: ``timeout_s``, else ``RELAY_COLLECTIVE_TIMEOUT_S``, else torch's
    default (None). Pure. Raises ``InvalidSpec`` for a value that is not a positive number."""
    if timeout_s is None and env_value:
        try:
            timeout_s = float(env_value)
        except ValueError:
            raise InvalidSpec(f"RELAY_COLLECTIVE_TIMEOUT_S={env_value!r} is not a number of seconds") from None
        if not timeout_s > 0:
            raise InvalidSpec(f"RELAY_COLLECTIVE_TIMEOUT_S={env_value!r} must be > 0 seconds")
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidSpec(f"timeout_s={timeout_s!r} must be a number of seconds > 0")
    return datetime.timedelta(seconds=timeout_s)
