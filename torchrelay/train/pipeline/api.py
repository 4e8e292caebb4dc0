"""``prepare``: turn a block list and a ``PipelineStrategy`` into this rank's pipeline stage.

Contract:
- Collective: every rank of the default process group calls ``prepare`` with the same
  arguments (``sample``/``sample_target`` only matter for profiling; every rank needs
  ``sample``, which is one micro-batch of inputs, when the plan is automatic).
- Ranks are laid out replica-major: rank = replica × stages + stage. Stage ``k`` of every
  replica runs blocks ``plan.stages[k]``; replicas of a stage average gradients.
- The plan: ``plan=`` a ``Plan`` or a boundary list (first block of each stage) is taken as
  given; otherwise every rank profiles every block on its own device (chained, in windows
  of about one stage's parameters),
  the link between ranks 0 and 1 is timed, and ``plan_stages`` cuts the model. Every rank
  computes the same plan from the same gathered numbers; rank 0's is broadcast to be sure.
- Blocks built on the meta device are materialised only on the stage that runs them (block
  ``i`` initialised with seed ``seed + i``); blocks already on a device are moved.
- Rank 0 writes the plan to ``$RELAY_METRICS_DIR/pipeline-plan.json`` (``publish_plan``)
  when that variable is set, for ``relay status`` to show.
- ``tensor_parallel: k`` (with ``data_parallel: fsdp``): a (dp × pp × tp) mesh, rank =
  (replica × stages + stage) × k + t; each stage replica is k ranks that split its blocks'
  attention and MLP linears (train.sharded.tensor_parallel) before FSDP shards them over the
  replicas, all k fed the same micro-batches, each sending to and receiving from its own
  place ``t`` in the neighbouring stages (torchtitan's meta → split → TP → FSDP → materialise).
- ``data_parallel: fsdp`` (with ``replicas`` ≥ 2, or tensor parallel): each stage's blocks are sharded over the
  stage's replicas in torchtitan's order — meta blocks, the plan (made with each rank's sharded
  memory, ``sharded_costs``), ``fully_shard`` per block, then materialised one block at a time
  (train.sharded.stages) — and rank 0 saves the mesh and what each rank holds as the artifact
  ``sharded-layout.json`` for ``relay status``.
- ``Pipeline.state_dict()`` holds only this stage's blocks, keyed by global block index
  (``"blocks.<i>.<param>"``), so stage checkpoints stitch into the whole model
  (``merge_stage_state_dicts``) and load into any other cut.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.spec import PipelineStrategy
from torchrelay.train.allocator import keep_freed_memory
from torchrelay.train.pipeline.meta import as_blocks, is_on_meta, materialize_module
from torchrelay.train.pipeline.partition import (BlockCost, DeviceSpec, Link, Plan,
                                                 near_optimal_cuts, plan_from_boundaries,
                                                 plan_stages, sharded_costs)
from torchrelay.train.pipeline.profile import measure_link, profile_blocks, time_stage
from torchrelay.train.pipeline.runtime import LeanPipeline, TorchPipeline
from torchrelay.train.pipeline.shm import connect_neighbours


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its plan, stage, blocks and runtime."""

    plan: Plan
    stage: int
    replica: int
    num_stages: int
    blocks: dict[int, nn.Module]
    runner: LeanPipeline | TorchPipeline

    @property
    def module(self) -> nn.Module:
        """This stage's blocks as one module (for optimizers and ``.train()``/``.eval()``)."""
        return nn.ModuleDict({str(i): b for i, b in self.blocks.items()})

    @property
    def is_first(self) -> bool:
        return self.runner.is_first

    @property
    def is_last(self) -> bool:
        return self.runner.is_last

    def parameters(self):
        return self.module.parameters()

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None
             ) -> torch.Tensor | None:
        """Forward+backward of one batch (see runtime.LeanPipeline.step). Collective."""
        return self.runner.step(inputs, targets)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"blocks.{i}.{k}": v for i, b in self.blocks.items()
                for k, v in b.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load this stage's blocks from a stage or whole-model state dict.

        Raises ``KeyError`` naming a missing key when ``strict``."""
        for i, block in self.blocks.items():
            prefix = f"blocks.{i}."
            own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            block.load_state_dict(own, strict=strict)


def merge_stage_state_dicts(states: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Stitch per-stage state dicts into the whole model's (keys ``blocks.<i>.<param>``)."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        merged.update(state)
    return merged


def default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _stage_ranks(num_stages: int, replicas: int, tp: int = 1, t: int = 0) -> list[list[int]]:
    """Per replica, the ranks of its stages at tensor-parallel place ``t`` (rank = (replica × stages + stage) × tp + t)."""
    return [[(r * num_stages + k) * tp + t for k in range(num_stages)] for r in range(replicas)]


def _resolve_strategy(strategy: PipelineStrategy | dict | None, ctx) -> PipelineStrategy:
    """``strategy`` as given, else the job spec's (``ctx.strategy``) when it is a pipeline, else the default."""
    if strategy is None and getattr(getattr(ctx, "strategy", None), "kind", None) == "pipeline":
        return ctx.strategy  # the job spec's, through torchrelay.train.init()
    if strategy is None:
        return PipelineStrategy(kind="pipeline")
    if isinstance(strategy, dict):
        return PipelineStrategy.model_validate({"kind": "pipeline", **strategy})
    return strategy


def _process_groups(layout: list[list[int]], rank: int, stage: int) -> tuple:
    """``(pipeline group, data-parallel group)`` of ``rank``; both None with one replica.

    Collective: every rank must create every group, in the same order.
    """
    pp_group = dp_group = None
    if len(layout) > 1:
        for ranks in layout:
            g = dist.new_group(ranks)
            if rank in ranks:
                pp_group = g
        for k in range(len(layout[0])):
            g = dist.new_group([replica[k] for replica in layout])
            if k == stage:
                dp_group = g
    return pp_group, dp_group


def _groups(shape, layout: list[list[int]], rank: int, stage: int, device: torch.device) -> tuple:
    """``(mesh or None, pipeline group, data-parallel group)``. With tensor parallel the (dp, pp, tp) mesh
    makes every group, on every rank in the same order; without, ``_process_groups``. Collective."""
    if shape.tp == 1:
        return (None, *_process_groups(layout, rank, stage))
    from torchrelay.train.sharded.prepare import build_mesh

    mesh = build_mesh(shape, device.type)
    return mesh, mesh.get_group("pp"), mesh.get_group("dp")


def _lean_runner(the_plan: Plan, own: dict[int, nn.Module], layout: list[list[int]], stage: int,
                 replica: int, strategy: PipelineStrategy, loss_fn: Callable, device: torch.device,
                 transport: str, pp_group, dp_group) -> LeanPipeline:
    """This rank's stage on the lean runtime, connected to its neighbours. Collective with them."""
    num_stages = len(layout[0])
    first, stop = the_plan.stages[stage].first, the_plan.stages[stage].stop
    module = nn.Sequential(*[own[i] for i in range(first, stop)])
    prev_rank = layout[replica][stage - 1] if stage > 0 else None
    next_rank = layout[replica][stage + 1] if stage < num_stages - 1 else None
    if transport not in ("auto", "shm", "gloo"):
        raise InvalidSpec(f"pipeline: transport {transport!r}; use 'auto', 'shm' or 'gloo'")
    prev_channel, next_channel = connect_neighbours(
        prev_rank, next_rank, enabled=transport != "gloo" and device.type == "cpu")
    return LeanPipeline(
        module, stage=stage, num_stages=num_stages, microbatches=strategy.microbatches,
        loss_fn=loss_fn, schedule=strategy.schedule, prev_rank=prev_rank,
        next_rank=next_rank, device=device, dp_group=dp_group, group=pp_group,
        prev_channel=prev_channel, next_channel=next_channel,
        split_backward=strategy.data_parallel != "fsdp")


def prepare(blocks: nn.Module | Sequence[nn.Module], loss_fn: Callable,
            strategy: PipelineStrategy | dict | None = None, ctx=None, *,
            sample: torch.Tensor | None = None, sample_target: torch.Tensor | None = None,
            device: torch.device | str | None = None, plan: Plan | Sequence[int] | None = None,
            optimizer_factory: Callable | None = None, mem_cap_bytes: int | None = None,
            runtime: Literal["auto", "lean", "torch"] = "auto", seed: int = 0,
            virtual_stages: int = 2, transport: Literal["auto", "shm", "gloo"] = "auto",
            refine: float = 0.06) -> Pipeline:
    """This rank's ``Pipeline`` for ``blocks`` under ``strategy``. Collective; blocks.

    ``strategy`` defaults to ``ctx.strategy`` when that is a pipeline strategy (the job
    spec's), else to ``PipelineStrategy()``; a dict is validated as one.

    ``refine`` (automatic plans, one stage per rank): the planned cut and those one block
    away predicted within this fraction of it (default 6%) are timed as whole stages on
    their ranks, and the fastest is kept with its measured stage times
    (``near_optimal_cuts``, ``time_stage``; a note in the plan says so); 0 plans from the
    profile alone.

    ``transport`` (lean runtime): "auto"/"shm" pass activations and gradients between two
    neighbour stages through shared memory (runtime.py, shm.py) when both are CPU ranks on
    one host, else gloo (a GPU rank through host copies); "gloo" always uses gloo send/recv.

    Raises ``InvalidSpec`` when the world size does not match stages × replicas, when an
    automatic plan has no ``sample``, or for a schedule the runtime cannot run;
    ``PlanInfeasible`` when no cut fits the memory caps.
    """
    if not dist.is_initialized():
        raise InvalidSpec("pipeline: torch.distributed is not initialised; call "
                          "torchrelay.train.init() (or init_process_group) first")
    strategy = _resolve_strategy(strategy, ctx)
    blocks = as_blocks(blocks)
    world, rank = dist.get_world_size(), dist.get_rank()
    replicas, tp = strategy.replicas, strategy.tensor_parallel
    num_stages = world // (replicas * tp) if strategy.stages == "auto" else strategy.stages
    if num_stages * replicas * tp != world or num_stages < 1:
        with_tp = f" × tensor_parallel={tp}" if tp > 1 else ""
        raise InvalidSpec(f"pipeline: stages={strategy.stages} × replicas={replicas}{with_tp} needs "
                          f"{num_stages * replicas * tp} workers but the job has {world}; set "
                          f"workers to stages × replicas{' × tensor_parallel' if tp > 1 else ''}")
    if strategy.data_parallel == "fsdp" and replicas < 2 and tp == 1:
        raise InvalidSpec(f"pipeline: data_parallel 'fsdp' shards each stage over its replicas, and "
                          f"replicas={replicas} leaves none to shard over; set replicas >= 2")
    device = torch.device(device) if device is not None else getattr(ctx, "device", None) \
        or default_device()
    if device.type == "cpu":
        keep_freed_memory()  # no page faults from re-allocating each step (allocator.py)
    interleaved = strategy.schedule == "interleaved_1f1b"
    chunks_per_rank = virtual_stages if interleaved else 1
    plan_stage_count = num_stages * chunks_per_rank
    if interleaved and strategy.microbatches % num_stages:
        raise InvalidSpec(f"pipeline: interleaved_1f1b needs microbatches divisible by stages "
                          f"({num_stages}); got {strategy.microbatches}")
    if runtime == "auto":
        runtime = "torch" if interleaved or dist.get_backend() == "nccl" else "lean"
    if runtime == "lean" and interleaved:
        raise InvalidSpec("pipeline: the lean runtime runs gpipe and 1f1b; use runtime='torch' "
                          "for interleaved_1f1b")
    from torchrelay.train.sharded.layout import MeshShape

    place = MeshShape(pp=num_stages, dp=replicas, tp=tp).coordinates(rank)
    stage, replica = place["pp"], place["dp"]

    the_plan = _make_plan(blocks, plan, plan_stage_count, num_stages, strategy, sample,
                          sample_target, loss_fn, device, optimizer_factory, mem_cap_bytes, seed,
                          refine)

    layout = _stage_ranks(num_stages, replicas, tp, place["tp"])
    mesh, pp_group, dp_group = _groups(MeshShape(pp=num_stages, dp=replicas, tp=tp), layout, rank, stage, device)

    my_plan_stages = [stage + v * num_stages for v in range(chunks_per_rank)]
    own = _own_blocks(blocks, the_plan, my_plan_stages, device, seed, strategy, dp_group, rank, num_stages,
                      mesh)
    if strategy.data_parallel == "fsdp":
        dp_group = None  # each sharded block reduce-scatters its own gradients over the replicas

    if runtime == "lean":
        runner = _lean_runner(the_plan, own, layout, stage, replica, strategy, loss_fn, device,
                              transport, pp_group, dp_group)
    else:
        modules = [nn.Sequential(*[own[i] for i in the_plan.stages[ps].blocks])
                   for ps in my_plan_stages]
        runner = TorchPipeline(modules, my_plan_stages, num_stages=plan_stage_count,
                               microbatches=strategy.microbatches, loss_fn=loss_fn,
                               schedule=strategy.schedule, device=device, group=pp_group,
                               dp_group=dp_group)
    if rank == 0:
        publish_plan(the_plan)
    return Pipeline(plan=the_plan, stage=stage, replica=replica, num_stages=num_stages,
                    blocks=own, runner=runner)


def _own_blocks(blocks, the_plan: Plan, my_plan_stages: list[int], device: torch.device, seed: int,
                strategy: PipelineStrategy, dp_group, rank: int, num_stages: int, mesh=None) -> dict[int, nn.Module]:
    """This rank's blocks on ``device``: materialised (block ``i`` under ``seed + i``) or moved, or under
    ``data_parallel: fsdp`` split over the stage's tensor-parallel group (``mesh``'s ``tp``, when given),
    sharded over its replicas and then materialised. Collective under fsdp."""
    indices = [i for ps in my_plan_stages for i in the_plan.stages[ps].blocks]
    if strategy.data_parallel != "fsdp":
        return {i: materialize_module(blocks[i], device, seed + i) if is_on_meta(blocks[i])
                else blocks[i].to(device) for i in indices}
    from torchrelay.train.sharded.layout import MeshShape
    from torchrelay.train.sharded.prepare import publish_layout
    from torchrelay.train.sharded.stages import shard_stage_blocks, stage_holding

    tp = strategy.tensor_parallel
    own, split = shard_stage_blocks({i: blocks[i] for i in indices}, dp_group, device, seed,
                                    lambda template, block_seed: materialize_module(template, "cpu", block_seed),
                                    mesh=mesh)
    shape = MeshShape(pp=num_stages, dp=strategy.replicas, tp=tp)
    full_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    publish_layout(shape, stage_holding(rank, shape, own, full_bytes, split), rank)
    return own


PLAN_FILE = "pipeline-plan.json"


def publish_plan(plan: Plan, env=os.environ) -> str | None:
    """Write ``plan.to_dict()`` (and its text) to ``$RELAY_METRICS_DIR/pipeline-plan.json``
    for the agent to ship and ``relay status`` to show; atomic (temp file + rename).
    Returns the path, or None outside a torchrelay job (no ``RELAY_METRICS_DIR``)."""
    folder = env.get("RELAY_METRICS_DIR")
    if not folder:
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, PLAN_FILE)
    tmp = f"{path}.tmp"
    body = {**plan.to_dict(), "text": plan.describe()}
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)
    if env.get("RELAY_JOB_ID"):
        # also a job artifact: the server serves it and `relay status` shows the plan
        from torchrelay.train.artifacts import save_artifact

        save_artifact(PLAN_FILE, json.dumps(body, indent=2).encode())
    return path


def _first_rank(plan_stage: int, num_stages: int, strategy: PipelineStrategy) -> int:
    """The rank that runs ``plan_stage`` in replica 0 at tensor-parallel place 0 (its device speaks for the stage)."""
    return (plan_stage % num_stages) * strategy.tensor_parallel


def _make_plan(blocks, plan, plan_stage_count, num_stages, strategy, sample, sample_target,
               loss_fn, device, optimizer_factory, mem_cap_bytes, seed, refine) -> Plan:
    schedule = "1f1b" if strategy.schedule == "interleaved_1f1b" else strategy.schedule
    if isinstance(plan, Plan):
        if len(plan.stages) != plan_stage_count or plan.num_blocks != len(blocks):
            raise InvalidSpec(f"pipeline: the given plan has {len(plan.stages)} stages for "
                              f"{plan.num_blocks} blocks; this job needs {plan_stage_count} "
                              f"stages for {len(blocks)} blocks")
        return plan
    if plan is not None or plan_stage_count == 1:
        bounds = [*(plan if plan is not None else [0]), len(blocks)]
        unit = [BlockCost(time_s=1.0, name=f"{i}:{type(b).__name__}")
                for i, b in enumerate(blocks)]
        names = [None] * dist.get_world_size()  # stages may sit on different devices
        dist.all_gather_object(names, str(device))
        devices = [DeviceSpec(f"rank{_first_rank(k, num_stages, strategy)}:"
                              f"{names[_first_rank(k, num_stages, strategy)]}") for k in range(plan_stage_count)]
        return plan_from_boundaries(unit, devices, bounds, microbatches=strategy.microbatches,
                                    schedule=schedule)
    if sample is None:
        raise InvalidSpec("pipeline: stages are planned from a profile, which needs sample= "
                          "(one micro-batch of inputs); or pass plan= (first block of each "
                          "stage)")
    # Profile in chained windows of about one stage's worth of parameters: a stage holds
    # that much anyway, and chained blocks time as the stage will run them (profile.py).
    model_bytes = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters())
    block_inputs: list[torch.Tensor] = []
    costs = profile_blocks(blocks, sample, device, optimizer_factory=optimizer_factory,
                           loss_fn=loss_fn, sample_target=sample_target, seed=seed,
                           window_bytes=-(-model_bytes // plan_stage_count),
                           block_inputs=block_inputs)
    cap = mem_cap_bytes
    if cap is None and device.type == "cuda":
        cap = int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    if strategy.data_parallel == "fsdp":  # each rank holds 1/replicas of its stage, plus one block gathered
        # (tensor parallel splits only a stage's attention and MLP linears: counted as if it split all, a
        # plan that is optimistic for embeddings and heads)
        costs, reserve = sharded_costs(costs, strategy.replicas * strategy.tensor_parallel)
        cap = None if cap is None else max(0, cap - reserve)
    # each rank's own block times, device and memory cap: stages may sit on different devices
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, ([c.time_s for c in costs], str(device), cap))
    tp = strategy.tensor_parallel  # stage 1's first rank is rank tp (rank 1 is stage 0's next tp place)
    link = measure_link(0, tp, device=device) if dist.get_world_size() > tp else Link()
    links = [None] * dist.get_world_size()
    dist.all_gather_object(links, (link.bandwidth_bytes_per_s, link.latency_s))
    link = Link(*links[0])
    devices = []
    for k in range(plan_stage_count):
        times, device_name, device_cap = per_rank[_first_rank(k, num_stages, strategy)]
        devices.append(DeviceSpec(name=f"rank{_first_rank(k, num_stages, strategy)}:{device_name}",
                                  mem_cap_bytes=device_cap, block_times_s=tuple(times)))
    chosen = plan_stages(costs, devices, link, strategy.microbatches, schedule)
    if refine > 0 and plan_stage_count == num_stages > 1:
        chosen = _measure_near_optimal(chosen, blocks, costs, devices, link, strategy,
                                       schedule, block_inputs, loss_fn, sample_target, device,
                                       seed, num_stages, refine)
    result = [chosen]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _measure_near_optimal(plan, blocks, costs, devices, link, strategy, schedule,
                          block_inputs, loss_fn, sample_target, device, seed,
                          num_stages, tolerance) -> Plan:
    """``plan``, or a neighbouring cut predicted within ``tolerance`` of it that runs faster
    when each rank times its own stage of every such cut as a whole (``time_stage``), all
    ranks at once as the pipeline will. The returned plan's stage compute times are those
    measured stage times (closer to the run than block sums), and a note lists every
    candidate's. Collective: every rank derives the same candidates from the same gathered
    numbers."""
    candidates = near_optimal_cuts(costs, devices, plan, link, strategy.microbatches, schedule,
                                   tolerance=tolerance)
    tp = strategy.tensor_parallel
    stage = (dist.get_rank() // tp) % num_stages
    mine = [time_stage(blocks, bounds[stage], bounds[stage + 1], block_inputs[bounds[stage]],
                       device, loss_fn=loss_fn, sample_target=sample_target, seed=seed)
            for bounds in candidates]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    slowest = [max(everyone[k * tp][i] for k in range(num_stages)) for i in range(len(candidates))]
    best = min(range(len(candidates)), key=slowest.__getitem__)
    chosen = plan if best == 0 else plan_from_boundaries(
        costs, devices, candidates[best], link, strategy.microbatches, schedule)
    measured = tuple(dataclasses.replace(st, compute_s=everyone[k * tp][best])
                     for k, st in enumerate(chosen.stages))
    timed = ", ".join(f"{bounds[1:-1]} {t * 1e3:.2f} ms" for bounds, t in zip(candidates, slowest))
    note = (f"stage times measured as whole stages; cuts predicted within {tolerance:.0%} "
            f"(slowest stage per micro-batch): {timed}; chose {candidates[best][1:-1]}")
    return dataclasses.replace(chosen, stages=measured, notes=(*plan.notes, note),
                               equal_split_bottleneck_s=plan.equal_split_bottleneck_s)
