"""Parameter-server training: server shards hold the model, workers push gradients and pull it.

A job with ``strategy: {kind: parameter_server, servers: S, ...}`` and ``workers: W`` runs as
``W + S`` torchrun ranks: ranks ``0 … W-1`` are workers, ranks ``W … W+S-1`` are servers
(shard ``rank - W``). The training script is the same as for every other strategy; the
library calls, on every rank:

- ``run_server_role_if_assigned(ctx)`` — on a server rank it serves until every worker has
  finished and then ends the process with exit code 0 (it never returns there); on a worker
  rank, or when the strategy is not ``parameter_server``, it returns at once.
- ``worker_world(ctx) -> (rank, num_workers)`` — the world to shard data over: workers only;
  ``worker_process_group()`` — a workers-only process group for collectives among workers.
- ``prepare(model, optimizer, strategy, ctx) -> (model, optimizer)`` — on a worker: the model
  is the same module with its parameters moved into flat buffers, the optimizer a
  ``PSOptimizer`` whose ``step()`` pushes gradients and pulls fresh parameters (the optimizer
  passed in is kept only for ``param_groups``; the update runs on the servers with
  ``strategy.optimizer``).

``ctx`` is duck-typed: ``.rank``, ``.world_size``; optional ``.strategy`` (else the
``RELAY_STRATEGY`` environment variable) and ``.store`` (else the default process group's store,
else ``TORCHRELAY_PS_STORE=host:port``). Servers must not be asked to join collectives on
the default process group: collectives among workers go over ``worker_process_group()``.
Environment knobs: ``TORCHRELAY_PS_HOST`` (address servers publish), ``TORCHRELAY_PS_SHM=0``
(payloads on the socket even when a shard is on the worker's host; default: shared memory there),
``TORCHRELAY_PS_MAX_SHARD_RESTARTS`` (default 3), ``TORCHRELAY_PS_RECONNECT_S`` (default 120).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from torchrelay.spec import ParameterServerStrategy
from torchrelay.train.ps.client import PSOptimizer
from torchrelay.train.ps.rendezvous import ShardDirectory, advertised_host, resolve_store

__all__ = ["PSOptimizer", "prepare", "run_server_role_if_assigned", "worker_world", "worker_process_group",
           "strategy_of"]


def strategy_of(ctx: Any) -> Any:
    """The job's strategy: ``ctx.strategy``, else ``RELAY_STRATEGY`` (JSON), else None."""
    strategy = getattr(ctx, "strategy", None)
    if strategy is not None:
        return strategy
    raw = os.environ.get("RELAY_STRATEGY")
    if not raw:
        return None
    data = json.loads(raw)
    return ParameterServerStrategy.model_validate(data) if data.get("kind") == "parameter_server" else data


def _ps_strategy(ctx: Any) -> ParameterServerStrategy | None:
    strategy = strategy_of(ctx)
    return strategy if isinstance(strategy, ParameterServerStrategy) else None


def _num_workers(ctx: Any, strategy: ParameterServerStrategy) -> int:
    workers = int(ctx.world_size) - strategy.servers
    if workers < 1:
        raise ValueError(f"world_size={ctx.world_size} leaves no workers next to servers={strategy.servers}; "
                         f"the platform must launch workers + servers ranks")
    return workers


def worker_world(ctx: Any) -> tuple[int, int]:
    """``(rank, num_workers)`` to shard data over. Not parameter-server: ``(rank, world_size)``.

    Raises ``ValueError`` when called on a server rank (servers hold no data).
    """
    strategy = _ps_strategy(ctx)
    if strategy is None:
        return int(ctx.rank), int(ctx.world_size)
    workers = _num_workers(ctx, strategy)
    if int(ctx.rank) >= workers:
        raise ValueError(f"rank {ctx.rank} is a parameter server (ranks {workers}..{ctx.world_size - 1}); "
                         "it has no share of the data")
    return int(ctx.rank), workers


def run_server_role_if_assigned(ctx: Any) -> None:
    """On a server rank: serve this rank's shard until all workers are done, then exit(0).

    Returns at once on a worker rank or for another strategy. Raises ``RuntimeError`` if the
    shard keeps dying past ``TORCHRELAY_PS_MAX_SHARD_RESTARTS``.
    """
    strategy = _ps_strategy(ctx)
    if strategy is None:
        return
    workers = _num_workers(ctx, strategy)
    global _WORKER_GROUP
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and _WORKER_GROUP is None:
        # new_group is collective over the whole world: made here, where every rank passes.
        _WORKER_GROUP = dist.new_group(ranks=list(range(workers)))
    if int(ctx.rank) < workers:
        return
    from torchrelay.train.ps.server import serve_shard_supervised

    directory = ShardDirectory(resolve_store(ctx))
    serve_shard_supervised(
        directory.read_plan(), int(ctx.rank) - workers, num_workers=workers, mode=strategy.mode,
        staleness=strategy.staleness, optimizer=strategy.optimizer, directory=directory,
        host=advertised_host(), max_restarts=int(os.environ.get("TORCHRELAY_PS_MAX_SHARD_RESTARTS", "3")))
    # A server rank has nothing left to do. Under the agent's worker supervisor (it sets
    # RELAY_RANK_STATUS_DIR) SystemExit(0) records that the rank returned, then the supervisor
    # ends the process without interpreter teardown; elsewhere (plain torchrun) ending here
    # with os._exit keeps it clear of the gloo abort at exit (DESIGN.md §6).
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get("RELAY_RANK_STATUS_DIR"):
        raise SystemExit(0)
    os._exit(0)


_WORKER_GROUP: Any = None


def worker_process_group() -> Any:
    """The workers-only process group (for barriers, metric reductions, checkpoint
    coordination among workers), made by ``run_server_role_if_assigned`` when a default
    process group exists; None otherwise. Never use the default group for collectives in a
    parameter-server job: the server ranks do not take part in them."""
    return _WORKER_GROUP


def prepare(model: torch.nn.Module, optimizer: Any, strategy: ParameterServerStrategy,
            ctx: Any) -> tuple[torch.nn.Module, PSOptimizer]:
    """Connect this worker to the server shards and return ``(model, ps_optimizer)``.

    Blocks until every shard is up and initialised (worker 0 seeds them with its parameters;
    every worker then starts from those). Raises ``ValueError`` on a server rank or when the
    workers' models differ.
    """
    rank, workers = worker_world(_WithStrategy(ctx, strategy))
    ps_optimizer = PSOptimizer(
        model, rank=rank, num_workers=workers, servers=strategy.servers, mode=strategy.mode,
        optimizer_config=strategy.optimizer, directory=ShardDirectory(resolve_store(ctx)),
        user_optimizer=optimizer, reconnect_timeout_s=float(os.environ.get("TORCHRELAY_PS_RECONNECT_S", "120")))
    return model, ps_optimizer


class _WithStrategy:
    def __init__(self, ctx: Any, strategy: ParameterServerStrategy) -> None:
        self.rank, self.world_size, self.strategy = ctx.rank, ctx.world_size, strategy
