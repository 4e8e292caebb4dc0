"""`relay data pack SRC DEST --shard-size 64MiB`: write a dataset into shard files in any store.

SRC is a local ``.pt`` (a dict or tuple of tensors), ``.npz`` or ``.npy`` file; DEST any store
URL (``s3://bucket/data/digits``, ``hdfs://…``, a folder). The store's endpoint and credentials
come from ``--option key=value`` (the store options of docs/storage.md), the environment or
``~/.aws``. Training reads it with ``rt.stream(DEST, batch_size=…)`` (docs/datasets.md).
"""
from __future__ import annotations

from pathlib import Path

import typer

from torchrelay.client.cli.common import OutputOpt, Output, console, fail, handle_errors, key_values, print_json

app = typer.Typer(help="datasets as shard files in a store (docs/datasets.md)", no_args_is_help=True)


@app.command("pack")
@handle_errors
def pack(src: Path = typer.Argument(..., help="a .pt (dict or tuple of tensors), .npz or .npy file"),
         dest: str = typer.Argument(..., help="store URL of the dataset, e.g. s3://bucket/data/name"),
         shard_size: str = typer.Option("64MiB", "--shard-size", help="bytes of samples per shard, e.g. 64MiB"),
         option: list[str] = typer.Option([], "--option", help="store option key=value (repeatable), e.g. "
                                          "endpoint_url=http://rgw:7480"),
         output: Output = OutputOpt) -> None:
    """Pack SRC into shards and an index at DEST."""
    from torchrelay.shards.format import parse_size
    from torchrelay.shards.pack import pack as pack_samples
    from torchrelay.shards.pack import read_source

    options = key_values(option, "--option")
    try:
        parse_size(shard_size)
        columns = read_source(src)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    index = pack_samples(columns, dest, shard_size=shard_size, storage_options=options)
    if output == Output.json:
        return print_json({"url": dest, "samples": index.samples, "shards": len(index.shards),
                           "bytes": sum(s.bytes for s in index.shards)})
    console.print(f"{dest}: {index.samples} samples in {len(index.shards)} shard(s) "
                  f"({sum(s.bytes for s in index.shards) / 2**20:.1f} MiB)", markup=False, highlight=False)
