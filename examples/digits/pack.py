"""Pack the digits training split into shard files in a store, for ``train.py --data URL``.

    python pack.py s3://bucket/datasets/digits [--seed 0] [--shard-size 16KiB]
    python pack.py /shared/datasets/digits

The same split as ``load_split(seed)`` (the test 20 % stays out); samples are (image, label)
tuples. Any store URL works (the store's endpoint and credentials from the environment or
``~/.aws``, see docs/storage.md). ``relay data pack`` does the same for a ``.pt``/``.npz`` file.
"""
from __future__ import annotations

import argparse

from model import load_split

from torchrelay.shards import pack


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="store URL of the dataset")
    parser.add_argument("--seed", type=int, default=0, help="the split's seed (train.py --seed)")
    parser.add_argument("--shard-size", default="64KiB", help="bytes of samples per shard (1,437 samples = 375 KiB)")
    args = parser.parse_args(argv)
    train_set, _test = load_split(args.seed)
    index = pack(train_set.tensors, args.dest, shard_size=args.shard_size)
    print(f"{args.dest}: {index.samples} samples in {len(index.shards)} shards", flush=True)


if __name__ == "__main__":
    main()
