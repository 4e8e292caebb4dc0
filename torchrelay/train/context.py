"""Who this worker is, and the process group it trains in.

Contract:
- ``context_from_env(env)`` is pure: it reads torchrun's variables (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) and torchrelay's (``RELAY_JOB_ID``, ``RELAY_ATTEMPT``,
  ``RELAY_STRATEGY``, ``RELAY_CHECKPOINT``) into a ``Context`` without touching devices or
  sockets. Missing variables mean "one process, no job": rank 0 of a world of 1, DDP.
  Malformed ones raise ``InvalidSpec`` naming the variable and its value.
- ``init()`` builds the process group from that environment (gloo on CPU, nccl when CUDA is
  available and ``LOCAL_RANK`` names a device) and returns the ``Context``. Idempotent: a
  second call returns the same object; a process group the script made itself is adopted.
  A world of 1 without torchrun's rendezvous variables gets no process group at all.
- ``prepare(model, optimizer)`` applies the strategy: DDP (a no-op wrapper with the same
  ``.module`` / ``no_sync()`` surface in a world of 1), or hands off to ``train.sync`` /
  ``train.ps``. The optimizer it returns is remembered so ``report()`` can merge its
  ``metrics()``.
- ``finish()`` lets the optimizer make replicas agree at the end (final averaging); collective.
- ``shutdown()`` flushes metrics, closes the optimizer's connections (parameter server),
  runs ``gc.collect()`` and destroys the process group
  (DESIGN.md §6: DDP's reducer sits in a reference cycle; collecting it before
  ``destroy_process_group`` avoids the gloo abort at interpreter exit). Idempotent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import importlib
import json
import os
import sys
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
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


# ---------------------------------------------------------------- pure: env -> Context


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


def parse_strategy(raw: str | None) -> Any:
    """The validated strategy model of ``RELAY_STRATEGY`` JSON; DDP when unset. Raises ``InvalidSpec``."""
    if raw is None or raw.strip() == "":
        return DDPStrategy()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise InvalidSpec(f"RELAY_STRATEGY={raw!r} is not JSON ({exc.msg}); "
                          'expected e.g. {"kind": "ddp"}') from None
    try:
        return _STRATEGY_ADAPTER.validate_python(data)
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
                   parameter_server: bool = False) -> tuple[str, str]:
    """(backend, device string) for a worker. Pure. Raises ``InvalidSpec`` for an unusable request.

    Under ``parameter_server`` the job's process group is gloo on every rank by default: its
    servers run on CPUs (often on CPU nodes, with their own resources) and every rank must
    build the same backend; gradients and parameters travel over the parameter server's own
    transport, not the group. A worker with a GPU still trains on it."""
    if requested is not None and requested not in ("gloo", "nccl", "mpi"):
        raise InvalidSpec(f"backend={requested!r} is not one of 'gloo', 'nccl', 'mpi'")
    on_gpu = cuda_devices > 0 and local_rank < cuda_devices
    if requested == "nccl" and not on_gpu:
        raise InvalidSpec(f"backend='nccl' needs a CUDA device for LOCAL_RANK={local_rank}, "
                          f"but {cuda_devices} are visible; use backend='gloo'")
    if parameter_server and requested is None:
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


# ---------------------------------------------------------------- process-wide state

_context: Context | None = None
_optimizer: Any = None


def current_context() -> Context:
    """The context of ``init()`` if it ran, else one read from the environment (no process group)."""
    return _context if _context is not None else context_from_env(os.environ)


def current_optimizer() -> Any:
    """The optimizer ``prepare()`` returned last, or None."""
    return _optimizer


def init(backend: str | None = None, timeout_s: float | None = None) -> Context:
    """Join the job's process group (from torchrun's env) and return this worker's ``Context``.

    Idempotent. Blocks until every rank joined (up to ``timeout_s``, default torch's, or
    ``RELAY_COLLECTIVE_TIMEOUT_S`` when set). Does not return on parameter-server ranks.
    Raises ``InvalidSpec`` for malformed environment values or an unusable backend.
    """
    global _context
    if _context is not None:
        return _context
    ctx = context_from_env(os.environ)
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dist.is_available() and dist.is_initialized():
        # the script (or a framework) made the group itself: adopt it rather than make a second
        ctx.backend = str(dist.get_backend())
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
        ctx.device = torch.device(f"cuda:{ctx.local_rank}" if ctx.backend == "nccl" else "cpu")
        ctx.distributed = True
    else:
        chosen_backend, device = choose_backend(backend, cuda_devices, ctx.local_rank,
                                                parameter_server=ctx.strategy.kind == "parameter_server")
        ctx.device = torch.device(device)
        if ctx.device.type == "cuda":
            torch.cuda.set_device(ctx.device)
        has_rendezvous = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
        if ctx.world_size > 1 and not has_rendezvous:
            raise InvalidSpec(f"WORLD_SIZE={ctx.world_size} but MASTER_ADDR/MASTER_PORT are not set; "
                              "start the script with torchrun or as a torchrelay job")
        if has_rendezvous and "WORLD_SIZE" in os.environ:
            kwargs: dict[str, Any] = {}
            timeout = collective_timeout(timeout_s, os.environ.get("RELAY_COLLECTIVE_TIMEOUT_S"))
            if timeout is not None:
                kwargs["timeout"] = timeout
            if chosen_backend == "nccl":
                kwargs["device_id"] = ctx.device  # eager NCCL init, bound to this rank's device
            dist.init_process_group(backend=chosen_backend, init_method="env://",
                                    rank=ctx.rank, world_size=ctx.world_size, **kwargs)
            ctx.distributed = True
            ctx.backend = chosen_backend
    _context = ctx
    _report_module().install_writer(ctx.rank)
    if os.environ.get("RELAY_JOB_ID"):
        from torchrelay.train import preempt

        preempt.install()  # SIGTERM from the platform becomes a request to checkpoint and stop
    if ctx.strategy.kind == "parameter_server":
        ps = _import_strategy_module("torchrelay.train.ps")
        hook = getattr(ps, "run_server_role_if_assigned", None)
        if hook is not None:
            hook(ctx)
    return ctx


def _import_strategy_module(name: str) -> Any:
    return importlib.import_module(name)


def _report_module() -> Any:
    # the package re-exports the function ``report``, which hides the module of the same name
    return importlib.import_module("torchrelay.train.report")


# ---------------------------------------------------------------- prepare


class LocalModule(torch.nn.Module):
    """What ``prepare`` returns for DDP in a world of 1: the model, with DDP's surface.

    ``.module`` is the wrapped model and ``state_dict()`` keys carry the same ``module.``
    prefix as DDP's, so a checkpoint moves between world sizes unchanged.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside whatever ``prepare`` wrapped it in (idempotent)."""
    while isinstance(model, (LocalModule, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def prepare(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """Apply the job's strategy to ``model`` and ``optimizer``; returns the pair to train with.

    Moves the model to the context's device (the optimizer keeps its parameters: ``Module.to``
    changes them in place). Calls ``init()`` first if needed. Raises ``InvalidSpec`` for the
    pipeline strategy, which cuts the model and has its own entry point.
    """
    global _optimizer
    ctx = init()
    kind = ctx.strategy.kind
    if kind == "pipeline":
        raise InvalidSpec("strategy kind 'pipeline' cannot be applied by torchrelay.train.prepare(model, "
                          "optimizer): a pipeline cuts the model into stages; use torchrelay.train.pipeline")
    if kind == "ddp" and ctx.world_size == 1:
        _optimizer = optimizer
        return LocalModule(model.to(ctx.device)), optimizer
    # ddp goes through sync.prepare too: DistributedDataParallel with a hook that counts the
    # bytes each step sends, so every strategy reports `bytes_sent` the same way
    module_name = {"ddp": "torchrelay.train.sync", "local_sgd": "torchrelay.train.sync", "diloco": "torchrelay.train.sync",
                   "final_average": "torchrelay.train.sync", "parameter_server": "torchrelay.train.ps"}.get(kind)
    if module_name is None:
        raise InvalidSpec(f"strategy kind {kind!r} is not known to torchrelay.train.prepare")
    try:
        strategy_module = _import_strategy_module(module_name)
    except ImportError as exc:
        raise InvalidSpec(f"strategy kind {kind!r} needs {module_name}, which cannot be imported: {exc}") from exc
    if not hasattr(strategy_module, "prepare"):
        raise InvalidSpec(f"strategy kind {kind!r} needs {module_name}.prepare, which this installation lacks")
    model, optimizer = strategy_module.prepare(model, optimizer, ctx.strategy, ctx)
    _optimizer = optimizer
    return model, optimizer


# ---------------------------------------------------------------- shutdown


def finish() -> None:
    """End of training: make replicas agree where the strategy let them drift apart.

    Calls the prepared optimizer's ``finish()`` (final averaging, the last local-SGD period);
    a no-op for DDP and for optimizers without one. Collective: call it on every worker rank,
    before evaluating or saving the final model. Idempotent.
    """
    hook = getattr(_optimizer, "finish", None)
    if callable(hook):
        hook()


def shutdown() -> None:
    """Flush metrics, close the prepared optimizer's connections, collect garbage, destroy the
    default process group (ours or adopted). Idempotent.

    Call it last, on every rank; afterwards ``init()`` may build a new group. The optimizer's
    ``close()`` (parameter server: tells the shards this worker is done) runs if it has one.
    """
    global _context, _optimizer
    optimizer, _optimizer = _optimizer, None
    try:
        if _context is not None:
            from torchrelay.train.checkpoint import wait_for_checkpoint

            try:
                wait_for_checkpoint()  # an async save still in flight needs the process group
            except Exception as exc:  # noqa: BLE001 - reported, and shutdown must still run
                print(f"torchrelay: the last checkpoint did not complete: {exc}", file=sys.stderr, flush=True)
        _report_module().close_writer()
        close = getattr(optimizer, "close", None)
        if callable(close):
            close()
    finally:
        del optimizer
        if dist.is_available() and dist.is_initialized():
            gc.collect()  # DDP's reducer sits in a reference cycle: free it while the group lives
            dist.destroy_process_group()
        _context = None
