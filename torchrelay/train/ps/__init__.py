"""Parameter-server training: server shards hold the model, workers push gradients and pull it.

A job with ``strategy: {kind: parameter_server, servers: S, ...}`` and ``workers: W`` runs as
``W + S`` torchrun ranks laid out by ``torchrelay.layout.RankLayout``: ranks ``0 … W-1`` are
workers, ranks ``W … W+S-1`` are servers (shard ``rank - W``). The training script is the same
as for every other strategy; the library calls, on every rank:

- ``run_server_role_if_assigned(ctx)`` — on a server rank it reports its shard's memory
  (``memory_parameters``, ``memory_optimizer_state``, ``memory_training_state``, under
  ``init()``), serves until every worker has finished and then ends the process with exit
  code 0 (it never returns there); on a worker rank, or when the strategy is not
  ``parameter_server``, it returns at once.
- ``worker_world(ctx) -> (rank, num_workers)`` — the world to shard data over: workers only;
  ``worker_process_group()`` — a workers-only process group for collectives among workers.
- ``prepare(model, optimizer, strategy, ctx) -> (model, optimizer)`` — on a worker: the model
  is the same module with its parameters moved into flat buffers, the optimizer a
  ``PSOptimizer`` whose ``step()`` pushes gradients and pulls fresh parameters (the optimizer
  passed in is kept only for ``param_groups``; the update runs on the servers with
  ``strategy.optimizer``).

``ctx`` is duck-typed: ``.rank``, ``.world_size``; optional ``.strategy`` (else the
``RELAY_STRATEGY`` environment variable, read by ``train.environment``) and ``.store`` (else the
default process group's store, else ``RELAY_PS_STORE=host:port``). Servers must not be asked to
join collectives on the default process group: collectives among workers go over
``worker_process_group()`` (what else this changes in the library is ``train.roles``'s).
Environment knobs: ``RELAY_PS_HOST`` (address servers publish), ``RELAY_PS_SHM=0``
(payloads on the socket even when a shard is on the worker's host; default: shared memory there),
``RELAY_PS_MAX_SHARD_RESTARTS`` (default 3), ``RELAY_PS_RECONNECT_S`` (default 120).
"""
from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from torchrelay.spec import ParameterServerStrategy, Strategy
from torchrelay.train.environment import parse_strategy
from torchrelay.train.ps.client import PSOptimizer
from torchrelay.train.ps.rendezvous import ShardDirectory, advertised_host, resolve_store
from torchrelay.train.memory import MemoryFigures
from torchrelay.train.ps.plan import Plan
from torchrelay.train.ps.server import buffers_for, serve_shard_supervised, shard_memory
from torchrelay.train.report import flush, report
from torchrelay.train.roles import Roles
from torchrelay.train.session import current_session

__all__ = ["PSOptimizer", "prepare", "run_server_role_if_assigned", "worker_world", "worker_process_group",
           "strategy_of"]


def strategy_of(ctx: Any) -> Strategy | None:
    """The job's strategy: ``ctx.strategy``, else ``RELAY_STRATEGY``, else None. Raises ``InvalidSpec``
    for a malformed ``RELAY_STRATEGY``."""
    strategy = getattr(ctx, "strategy", None)
    if strategy is not None:
        return strategy
    raw = os.environ.get("RELAY_STRATEGY")
    return parse_strategy(raw) if raw else None


def _roles(ctx: Any) -> Roles:
    return Roles.of(int(ctx.rank), int(ctx.world_size), strategy_of(ctx))


def worker_world(ctx: Any) -> tuple[int, int]:
    """``(rank, num_workers)`` to shard data over. Not parameter-server: ``(rank, world_size)``.

    Raises ``ValueError`` when called on a server rank (servers hold no data), or when the world
    leaves no worker beside the servers.
    """
    return _roles(ctx).data_world()


def run_server_role_if_assigned(ctx: Any) -> None:
    """On a server rank: serve this rank's shard until all workers are done, then exit(0).

    Returns at once on a worker rank or for another strategy. Raises ``RuntimeError`` if the
    shard keeps dying past ``RELAY_PS_MAX_SHARD_RESTARTS``.
    """
    roles = _roles(ctx)
    if not roles.parameter_server:
        return
    session = current_session()
    if dist.is_available() and dist.is_initialized() and session.worker_group is None:
        # new_group is collective over the whole world: made here, where every rank passes.
        session.worker_group = dist.new_group(ranks=list(roles.layout.worker_ranks))
    if not roles.is_server:
        return
    strategy = strategy_of(ctx)
    directory = ShardDirectory(resolve_store(ctx))
    plan_json, index = directory.read_plan(), roles.layout.shard_of(roles.rank)
    _report_shard_memory(shard_memory(Plan.from_json(plan_json).shard(index), buffers_for(strategy.optimizer)))
    serve_shard_supervised(
        plan_json, index, num_workers=roles.layout.workers,
        mode=strategy.mode, staleness=strategy.staleness, optimizer=strategy.optimizer, directory=directory,
        host=advertised_host(), max_restarts=int(os.environ.get("RELAY_PS_MAX_SHARD_RESTARTS", "3")))
    # A server rank has nothing left to do. Under the agent's worker supervisor (it sets
    # RELAY_RANK_STATUS_DIR) SystemExit(0) records that the rank returned, then the supervisor
    # ends the process without interpreter teardown; elsewhere (plain torchrun) ending here
    # with os._exit keeps it clear of the gloo abort at exit (docs/design.md, exit-time abort).
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("RELAY_RANK_STATUS_DIR"):
        raise SystemExit(0)
    os._exit(0)


def _report_shard_memory(figures: MemoryFigures) -> None:
    """A server rank's ``memory_parameters``, ``memory_optimizer_state`` and ``memory_training_state``
    (its shard's, ``server.shard_memory``), reported once at step 0 and flushed, when the rank runs
    under ``torchrelay.train.init()`` (a job: ``relay metrics`` shows them); elsewhere nothing."""
    if current_session().context is None:
        return
    metrics = figures.as_metrics()
    report(0, **{k: metrics[k] for k in ("memory_parameters", "memory_optimizer_state", "memory_training_state")})
    flush()


def worker_process_group() -> Any:
    """The workers-only process group (for barriers, metric reductions, checkpoint
    coordination among workers), made by ``run_server_role_if_assigned`` when a default
    process group exists; None otherwise. Never use the default group for collectives in a
    parameter-server job: the server ranks do not take part in them."""
    return current_session().worker_group


def prepare(model: torch.nn.Module, optimizer: Any, strategy: ParameterServerStrategy,
            ctx: Any) -> tuple[torch.nn.Module, PSOptimizer]:
    """Connect this worker to the server shards and return ``(model, ps_optimizer)``.

    Blocks until every shard is up and initialised (worker 0 seeds them with its parameters;
    every worker then starts from those). Raises ``ValueError`` on a server rank or when the
    workers' models differ.
    """
    rank, workers = Roles.of(int(ctx.rank), int(ctx.world_size), strategy).data_world()
    ps_optimizer = PSOptimizer(
        model, rank=rank, num_workers=workers, servers=strategy.servers, mode=strategy.mode,
        optimizer_config=strategy.optimizer, directory=ShardDirectory(resolve_store(ctx)),
        user_optimizer=optimizer, reconnect_timeout_s=float(os.environ.get("RELAY_PS_RECONNECT_S", "120")))
    return model, ps_optimizer
