"""Who this worker is, and the process group it trains in: ``init``, ``prepare``, ``finish``, ``shutdown``.

Contract:
- The environment is read by ``train.environment`` (``context_from_env``: pure; malformed values
  raise ``InvalidSpec`` naming the variable and its value).
- ``init()`` builds the process group from that environment (gloo on CPU, nccl when CUDA is
  available and ``LOCAL_RANK`` names a device) and returns the ``Context``. Idempotent: a
  second call returns the same object; a process group the script made itself is adopted.
  A world of 1 without torchrun's rendezvous variables gets no process group at all.
- ``prepare(model, optimizer)`` applies the strategy: DDP (a no-op wrapper with the same
  ``.module`` / ``no_sync()`` surface in a world of 1), or hands off to ``train.sync`` /
  ``train.ps`` / ``train.sharded`` (fsdp). First it checks that the training state fits the
  worker's memory when the job gave one (``train.memory_check``: ``InsufficientMemory`` with
  the figures). The optimizer it returns is remembered (``train.session``) and called through
  the ``StrategyOptimizer`` protocol (``train.prepared``): ``report()`` merges its ``metrics()``.
- ``finish()`` lets the optimizer make replicas agree at the end (final averaging); collective.
- ``shutdown()`` flushes metrics, closes the optimizer's connections (parameter server),
  runs ``gc.collect()`` and destroys the process group (docs/design.md, exit-time abort:
  DDP's reducer sits in a reference cycle; collecting it before ``destroy_process_group``
  avoids the gloo abort at interpreter exit). Idempotent.

What differs under the parameter server (gloo on every rank, server ranks that serve in
``init`` and never return) is asked of ``train.roles``.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from torchrelay.errors import InvalidSpec
from torchrelay.train import sync
from torchrelay.train.checkpoint import wait_for_checkpoint
from torchrelay.train.environment import Context, choose_backend, collective_timeout, context_from_env
from torchrelay.train.preempt import install as install_stop_handler
from torchrelay.train.report import close_writer, install_writer
from torchrelay.train.memory_check import preflight
from torchrelay.train.memory_profile import ProfileOptimizer, profiling
from torchrelay.train.roles import Roles
from torchrelay.train.session import current_session
from torchrelay.train.sharded.module import ShardedModule
from torchrelay.train.sharded.module import full_state_dict as _gathered_state_dict
from torchrelay.train.wrapped import WrappedModule

__all__ = ["Context", "LocalModule", "current_context", "finish", "full_state_dict", "init", "prepare", "shutdown",
           "unwrap"]


def current_context() -> Context:
    """The context of ``init()`` if it ran, else one read from the environment (no process group)."""
    return current_session().known_context()


def init(backend: str | None = None, timeout_s: float | None = None) -> Context:
    """Join the job's process group (from torchrun's env) and return this worker's ``Context``.

    Idempotent. Blocks until every rank joined (up to ``timeout_s``, default torch's, or
    ``RELAY_COLLECTIVE_TIMEOUT_S`` when set). Does not return on parameter-server ranks.
    Raises ``InvalidSpec`` for malformed environment values or an unusable backend.
    """
    session = current_session()
    if session.context is not None:
        return session.context
    ctx = context_from_env(os.environ)
    roles = Roles.of(ctx.rank, ctx.world_size, ctx.strategy)
    if dist.is_available() and dist.is_initialized():
        # the script (or a framework) made the group itself: adopt it rather than make a second
        ctx.backend = str(dist.get_backend())
        ctx.rank, ctx.world_size = dist.get_rank(), dist.get_world_size()
        ctx.device = torch.device(f"cuda:{ctx.local_rank}" if ctx.backend == "nccl" else "cpu")
        ctx.distributed = True
    else:
        _join_process_group(ctx, backend, timeout_s, parameter_server=roles.parameter_server)
    session.context = ctx
    install_writer(ctx.rank)
    if os.environ.get("RELAY_JOB_ID"):
        install_stop_handler()  # SIGTERM from the platform becomes a request to checkpoint and stop
    if roles.parameter_server:
        from torchrelay.train import ps  # loaded only by the jobs that use it

        ps.run_server_role_if_assigned(ctx)
    return ctx


def _join_process_group(ctx: Context, backend: str | None, timeout_s: float | None, *,
                        parameter_server: bool) -> None:
    """Pick ``ctx``'s device and backend and, under torchrun's rendezvous, build the default group."""
    mixed = os.environ.get("RELAY_MIXED_DEVICES") == "1"
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if mixed and os.environ.get("RELAY_ACCELERATOR") == "cpu":
        cuda_devices = 0  # a CPU rank of a mixed job trains on what it was granted, whatever the node has
    chosen_backend, device = choose_backend(backend, cuda_devices, ctx.local_rank, parameter_server=parameter_server,
                                            mixed_devices=mixed)
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


# ---------------------------------------------------------------- prepare


class LocalModule(WrappedModule):
    """What ``prepare`` returns for DDP in a world of 1: the model, with DDP's surface.

    ``.module`` is the wrapped model and ``state_dict()`` keys carry the same ``module.``
    prefix as DDP's, so a checkpoint moves between world sizes unchanged.
    """

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside whatever ``prepare`` wrapped it in (idempotent)."""
    while isinstance(model, (LocalModule, ShardedModule, torch.nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, keys of the user's model, on rank 0 only (CPU tensors); ``{}`` on
    the other ranks. Collective under fsdp (the shards are gathered to rank 0): call it on every rank,
    and only when the whole model is wanted (an artifact)."""
    return _gathered_state_dict(unwrap(model))


def _strategy_prepare(kind: str) -> Callable[..., tuple[torch.nn.Module, Any]]:
    """The ``prepare(model, optimizer, strategy, ctx)`` of the module that applies ``kind``."""
    if kind in sync.SYNC_KINDS:
        # ddp goes through sync.prepare too: DistributedDataParallel with a hook that counts the
        # bytes each step sends, so every strategy reports `bytes_sent` the same way
        return sync.prepare
    if kind == "parameter_server":
        from torchrelay.train import ps  # loaded only by the jobs that use it

        return ps.prepare
    if kind == "fsdp":
        from torchrelay.train import sharded  # loaded only by the jobs that use it

        return sharded.prepare
    if kind == "pipeline":
        raise InvalidSpec("strategy kind 'pipeline' cannot be applied by torchrelay.train.prepare(model, "
                          "optimizer): a pipeline cuts the model into stages; use torchrelay.train.pipeline")
    raise InvalidSpec(f"strategy kind {kind!r} is not known to torchrelay.train.prepare")


def prepare(model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """Apply the job's strategy to ``model`` and ``optimizer``; returns the pair to train with.

    Moves the model to the context's device (the optimizer keeps its parameters: ``Module.to``
    changes them in place). Calls ``init()`` first if needed. Raises ``InvalidSpec`` for the
    pipeline strategy, which cuts the model and has its own entry point.
    """
    session = current_session()
    ctx = init()
    kind = ctx.strategy.kind
    strategy_prepare = _strategy_prepare(kind)
    if profiling(os.environ):  # `relay submit --dry-run --profile`: one process, the figures, then exit
        session.adopt_optimizer(ProfileOptimizer(optimizer, model, ctx.strategy, os.environ))
        return LocalModule(model.to(ctx.device)), session.optimizer
    if kind != "parameter_server":
        # before anything is allocated: a state that cannot fit fails here, with the figures
        preflight(model, optimizer, ctx.strategy, ctx.world_size, os.environ)
    if kind == "ddp" and ctx.world_size == 1:
        session.adopt_optimizer(optimizer)
        return LocalModule(model.to(ctx.device)), optimizer
    model, optimizer = strategy_prepare(model, optimizer, ctx.strategy, ctx)
    session.adopt_optimizer(optimizer)
    return model, optimizer


# ---------------------------------------------------------------- shutdown


def finish() -> None:
    """End of training: make replicas agree where the strategy let them drift apart.

    Calls the prepared optimizer's ``finish()`` (final averaging, the last local-SGD period);
    a no-op for DDP and before ``prepare``. Collective: call it on every worker rank, before
    evaluating or saving the final model. Idempotent.
    """
    current_session().hooks.finish()


def shutdown() -> None:
    """Flush metrics, close the prepared optimizer's connections, collect garbage, destroy the
    default process group (ours or adopted). Idempotent.

    Call it last, on every rank; afterwards ``init()`` may build a new group. The optimizer's
    ``close()`` (parameter server: tells the shards this worker is done) runs.
    """
    session = current_session()
    optimizer, hooks = session.forget_prepared()
    try:
        if session.context is not None:
            try:
                wait_for_checkpoint()  # an async save still in flight needs the process group
            except Exception as exc:  # noqa: BLE001 - reported, and shutdown must still run
                print(f"torchrelay: the last checkpoint did not complete: {exc}", file=sys.stderr, flush=True)
        close_writer()
        hooks.close()
    finally:
        del optimizer, hooks
        if dist.is_available() and dist.is_initialized():
            gc.collect()  # DDP's reducer sits in a reference cycle: free it while the group lives
            dist.destroy_process_group()
        session.context = None
