"""A small deterministic trainer for the fault-tolerance tests (regression MLP, synthetic data).

Same seed, same world size → the same final model, whether the run was interrupted or not:
data, initial weights and dropout come from the seed, ``TrainState`` restores step, data
position, optimizer and RNGs. Every step reports ``loss`` and ``attempt``; after a restore it
also reports ``resumed_from`` (the checkpoint's step) at that step, and prints it.

    python trainer.py [--epochs 2] [--samples 160] [--batch 4] [--sleep 0.2] [--seed 0]
                      [--fail-rank R --fail-code C]            # rank R exits C on every start
                      [--exit-rank R --exit-step S --exit-code C --exit-attempt A]
                                                               # rank R exits C after step S of attempt A

Checkpoints follow the job's policy (``checkpoint.every_steps``) and are taken early when the
platform asks the workers to stop (SIGTERM: preemption), after which the script returns.
Rank 0 saves the final model as the artifact ``model.pt``.
"""
import argparse
import os
import sys


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds slept after each step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-rank", type=int, default=None)
    p.add_argument("--fail-code", type=int, default=7)
    p.add_argument("--exit-rank", type=int, default=None)
    p.add_argument("--exit-step", type=int, default=0)
    p.add_argument("--exit-code", type=int, default=5)
    p.add_argument("--exit-attempt", type=int, default=1)
    return p.parse_args(argv)


args = parse_args(sys.argv[1:])
rank = int(os.environ.get("RANK", "0"))
if args.fail_rank == rank:  # before importing torch: fails fast, on every start
    print(f"rank {rank}: failing on purpose with code {args.fail_code} "
          f"(attempt {os.environ.get('RELAY_ATTEMPT', '?')})", flush=True)
    sys.exit(args.fail_code)

import time  # noqa: E402

import torch  # noqa: E402

import torchrelay.train as rt  # noqa: E402


def make_data(seed: int, samples: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(16, 1))


def main() -> None:
    ctx = rt.init()
    model = make_model(args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = rt.prepare(model, optimizer)
    loader = rt.shard(make_data(args.seed, args.samples), batch_size=args.batch, seed=args.seed)
    state = rt.TrainState(model, optimizer, loader)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # dropout masks: per rank, restored by TrainState
    if state.restore():
        print(f"rank {ctx.rank}: resumed from step {state.step} (attempt {ctx.attempt})", flush=True)
        rt.report(state.step, resumed_from=state.step, attempt=ctx.attempt)
    for _epoch in state.epochs(args.epochs):
        for x, y in state.batches():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            rt.report(state.step, loss=loss.item(), attempt=ctx.attempt)
            if (ctx.rank == args.exit_rank and state.step == args.exit_step
                    and ctx.attempt == args.exit_attempt):
                print(f"rank {ctx.rank}: exiting with code {args.exit_code} after step {state.step}", flush=True)
                rt.flush_metrics()
                os._exit(args.exit_code)
            if rt.checkpoint_due(state.step):
                state.save()
            if rt.should_stop():
                print(f"rank {ctx.rank}: asked to stop; checkpoint committed at step {state.step}", flush=True)
                rt.shutdown()
                return
            if args.sleep:
                time.sleep(args.sleep)
    if ctx.is_main:
        rt.save_artifact("model.pt", rt.unwrap(model).state_dict())
        print(f"done after step {state.step}", flush=True)
    rt.shutdown()


main()
