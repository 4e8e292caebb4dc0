"""Train a small CNN on sklearn's 8×8 digits with torchrelay.train.

Runs unchanged as ``python train.py`` (one process), ``torchrun --nproc-per-node 2 train.py``
and as a torchrelay job (``relay submit job.yaml``). Reports loss, samples/s and the step count
every step, checkpoints per the job's policy (or ``--checkpoint-every``) and resumes from the
newest good checkpoint, evaluates on a fixed held-out 20 %, saves the model as the artifact
``model.pt`` and ends with the lines ``test_accuracy=…`` and ``model saved to …``.

``--data URL`` trains from the training split packed into a store by ``pack.py`` (``s3://…``,
``hdfs://…``, a shared folder), streamed with ``rt.stream``: fetched ahead, cached on local disk,
shuffled in a buffer, its position checkpointed. Without it the split is loaded into memory.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import torchrelay.train as rt
from model import DigitsCNN, load_split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="split, initial weights and data order")
    parser.add_argument("--data", default=None, help="store URL of the packed training split (pack.py); "
                        "default: in memory")
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help="steps between checkpoints (default: the job's checkpoint policy; 0 = none)")
    return parser.parse_args(argv)


def evaluate(model: torch.nn.Module, test: torch.utils.data.TensorDataset, device: torch.device) -> float:
    """Accuracy on the whole test set (one process; no collective, so any strategy can call it)."""
    images, labels = test.tensors[0].to(device), test.tensors[1].to(device)
    model.eval()
    with torch.no_grad():
        return (model(images).argmax(dim=1) == labels).double().mean().item()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = rt.init()
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    train_set, test_set = load_split(args.seed)
    model = DigitsCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = rt.prepare(model, optimizer)
    if args.data:  # every rank the same number of steps (even): DDP's collectives need it
        loader = rt.stream(args.data, batch_size=args.batch_size, seed=args.seed, shuffle_buffer=512, even=True)
    else:
        loader = rt.shard(train_set, batch_size=args.batch_size, seed=args.seed)
    steps_per_epoch = len(loader)
    total_steps = steps_per_epoch * args.epochs

    state = rt.TrainState(model, optimizer, loader)  # model, optimizer, position in the data, RNGs
    if state.restore() and ctx.is_main:
        print(f"resumed from the checkpoint at step {state.step}", flush=True)

    def checkpoint_due(at: int) -> bool:
        if args.checkpoint_every is None:
            return rt.checkpoint_due(at)
        return args.checkpoint_every > 0 and at % args.checkpoint_every == 0

    for epoch in state.epochs(args.epochs):  # sets the sampler's epoch; a resumed job starts mid-epoch
        model.train()
        last = time.perf_counter()
        loss = None
        for images, labels in state.batches():  # this epoch's batches not trained yet; state.step counts them
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            now = time.perf_counter()
            rt.report(state.step, loss=loss.item(), samples_per_s=args.batch_size * ctx.world_size / (now - last),
                      step_time_s=now - last, total_steps=total_steps, epoch=epoch)
            last = now
            if checkpoint_due(state.step):
                state.save()  # every rank; async when the job's checkpoint policy says so
        if ctx.is_main and loss is not None:
            print(f"epoch {epoch + 1}/{args.epochs} step {state.step}/{total_steps} loss={loss.item():.4f}",
                  flush=True)
    step = state.step
    rt.wait_for_checkpoint()  # an async save still in flight is committed before the job ends

    rt.finish()  # replicas agree before the final figure (a no-op for DDP; averages for final_average)
    if ctx.is_main:
        accuracy = evaluate(rt.unwrap(model), test_set, ctx.device)
        rt.report(step, accuracy=accuracy, total_steps=total_steps)
        url = rt.save_artifact("model.pt", rt.unwrap(model).state_dict())
        print(f"test_accuracy={accuracy:.3f}")
        print(f"model saved to {url}", flush=True)
    rt.shutdown()


if __name__ == "__main__":
    main()
