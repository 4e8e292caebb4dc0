"""Pack a text into a store as windows of token ids, for ``train.py --data URL``.

    python pack.py s3://bucket/datasets/charlm [--text FILE] [--context 64] [--shard-size 1MiB]
    python pack.py /shared/datasets/charlm

The text (default: Python's own sources, ``data.stdlib_text()``) is split as ``CharCorpus``
splits it (first 90 % training, the rest validation) and each split cut into consecutive windows
of ``context + 1`` characters: the training windows become the shard dataset at the URL, the
validation windows ``URL/val``, and the vocabulary ``URL/corpus.json`` (written last). Any store
URL works (the store's endpoint and credentials from the environment or ``~/.aws``, see
docs/storage.md).
"""
from __future__ import annotations

import argparse

from data import CharCorpus, pack_corpus, stdlib_text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", help="store URL of the dataset")
    parser.add_argument("--text", default=None, help="UTF-8 text file to pack (default: Python's own sources)")
    parser.add_argument("--context", type=int, default=64, help="characters per window (train.py --context)")
    parser.add_argument("--shard-size", default="1MiB", help="bytes of windows per shard (Python's sources: 4.1 MiB)")
    args = parser.parse_args(argv)
    corpus = CharCorpus.from_file(args.text) if args.text else CharCorpus.from_text(stdlib_text())
    meta = pack_corpus(corpus, args.dest, context=args.context, shard_size=args.shard_size)
    print(f"{args.dest}: {meta['windows']['train']} training and {meta['windows']['val']} validation windows "
          f"of {args.context} characters, vocabulary {len(meta['chars'])}", flush=True)


if __name__ == "__main__":
    main()
