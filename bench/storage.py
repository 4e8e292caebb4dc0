"""The store on S3 (the tests' private Ceph: mon + memstore OSD + radosgw) against raw s3fs, side by side.

Starts a Ceph with tests/services/ceph.py (Debian's ceph-mon, ceph-osd, radosgw; root installs
them when missing), then, rounds interleaved, medians:

- save: ``CheckpointStore.save`` of a ~``--mb`` MB model state (DCP plan; files of at most 64 MiB,
  each gathered once and sent by ``pipe_file`` while another thread hashes it, 4 at once;
  ``.metadata``, the manifest by ``If-None-Match``, ``latest``, pruning) vs one raw
  ``s3fs.pipe_file`` of the same bytes (its concurrent multipart upload);
- load: ``CheckpointStore.load`` (every file hashed against the manifest, then read into
  tensors) vs one raw ``s3fs.cat_file`` of those bytes;
- stream: ``rt.stream`` over a ``--data-mb`` MB dataset in 8 MiB shards, a cold cache
  (a ranged GET per shard, 2 read ahead; sha256 and the cache file's write; mmap; shuffle
  buffer, batches of 256) vs a raw sequential read of the same shards (``cat_file``,
  ``torch.load`` from memory, slices of 256), samples/s;
- train: the digits CNN (examples/digits, one process, batches of 32) per step, its data from
  memory (``rt.shard``) vs streamed from the bucket (``rt.stream``), epochs interleaved, all
  but the first.

Ends with ``RESULT {"s3_save_vs_raw", "s3_load_vs_raw", "stream_vs_raw_read",
"train_from_store_step_ratio", ...}``: each ours-vs-baseline as the baseline's time over ours
(1.0 = as fast; the goals are >= 0.85, 0.85, 0.9 and 0.95).

    OMP_NUM_THREADS=1 .venv/bin/python bench/storage.py [--mb 200] [--data-mb 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "examples" / "digits")]

import torch  # noqa: E402
from _env import header_line, package_versions, result_line  # noqa: E402

WIDTH = 2560


def make_state(mb: int) -> dict:
    torch.manual_seed(0)
    layers = max(1, round(mb * 1e6 / (WIDTH * (WIDTH + 1) * 4)))
    return {f"layer{i}.{name}": t for i in range(layers)
            for name, t in torch.nn.Linear(WIDTH, WIDTH).state_dict().items()}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_checkpoints(store, state: dict, rounds: int) -> dict:
    from torchrelay.train.checkpoint import CheckpointStore, decode_files

    raw_bytes = b"".join(t.numpy().tobytes() for t in state.values())
    raw_path = store.full_path("raw/state.bin")
    checkpoints = CheckpointStore(store, "bench", keep=1)
    times: dict[str, list[float]] = {k: [] for k in ("save", "raw_put", "load", "raw_get")}
    for step in range(1, rounds + 1):
        times["raw_put"].append(timed(lambda: store.fs.pipe_file(raw_path, raw_bytes)))
        times["save"].append(timed(lambda: checkpoints.save(state, step)))
        times["raw_get"].append(timed(lambda: store.fs.cat_file(raw_path)))
        times["load"].append(timed(lambda: checkpoints.load(decode=decode_files)))
        store.fs.rm(raw_path)
    med = {k: statistics.median(v) for k, v in times.items()}
    mb = len(raw_bytes) / 1e6
    print(f"checkpoint of {mb:.0f} MB, {rounds} rounds, medians:")
    for ours, raw, what in (("save", "raw_put", "save"), ("load", "raw_get", "load")):
        print(f"  {what:5s} CheckpointStore {med[ours]:6.2f} s ({mb / med[ours]:6.0f} MB/s)   raw s3fs "
              f"{med[raw]:6.2f} s ({mb / med[raw]:6.0f} MB/s)   ratio {med[raw] / med[ours]:.2f}")
    return {"s3_save_vs_raw": med["raw_put"] / med["save"], "s3_load_vs_raw": med["raw_get"] / med["load"],
            "checkpoint_mb": round(mb), "save_s": med["save"], "raw_put_s": med["raw_put"], "load_s": med["load"],
            "raw_get_s": med["raw_get"]}


def bench_stream(store, url: str, options: dict, data_mb: int, rounds: int) -> dict:
    import torchrelay.train as rt
    from torchrelay.shards import pack

    samples = data_mb * (1 << 20) // 1032  # 256 float32 + an int64 id
    index = pack({"x": torch.randn(samples, 256), "id": torch.arange(samples)}, f"{url}/data", shard_size="8MiB",
                 storage_options=options)
    data = store.full_path("data")

    def raw() -> int:
        count = 0
        for entry in index.shards:
            columns = torch.load(io.BytesIO(store.fs.cat_file(f"{data}/{entry.name}")), weights_only=True)
            for start in range(0, entry.samples, 256):
                count += len(columns["id"][start:start + 256])
        return count

    times: dict[str, list[float]] = {"ours": [], "raw": [], "warm": []}
    for _ in range(rounds):
        start = time.perf_counter()
        assert raw() == samples
        times["raw"].append(time.perf_counter() - start)
        cache = tempfile.mkdtemp(prefix="relay-bench-cache-")
        try:  # made outside the timing (an S3 client, the index): an epoch's samples/s is the figure
            loader = rt.stream(f"{url}/data", batch_size=256, shuffle_buffer=4096, rank=0, world_size=1,
                               cache_dir=cache, storage_options=options)
            loader.samples_this_epoch()
            for name in ("ours", "warm"):  # a cold cache, then the same epoch again from it
                start = time.perf_counter()
                assert sum(len(batch["id"]) for batch in loader) == samples
                times[name].append(time.perf_counter() - start)
        finally:
            shutil.rmtree(cache)
    rate = {k: samples / statistics.median(v) for k, v in times.items()}
    print(f"stream of {samples} samples ({data_mb} MB, {len(index.shards)} shards), medians:")
    print(f"  rt.stream, cold cache {rate['ours']:9.0f} samples/s   raw sequential read {rate['raw']:9.0f} "
          f"samples/s   ratio {rate['ours'] / rate['raw']:.2f}")
    print(f"  rt.stream, from its cache {rate['warm']:9.0f} samples/s   ratio {rate['warm'] / rate['raw']:.2f}")
    return {"stream_vs_raw_read": rate["ours"] / rate["raw"], "stream_samples_per_s": rate["ours"],
            "raw_read_samples_per_s": rate["raw"], "cached_stream_vs_raw_read": rate["warm"] / rate["raw"]}


def bench_digits(url: str, options: dict, epochs: int) -> dict:
    import torch.nn.functional as F
    from model import DigitsCNN, load_split

    import torchrelay.train as rt
    from torchrelay.shards import pack

    train_set, _ = load_split(0)
    pack(train_set.tensors, f"{url}/digits", shard_size="64KiB", storage_options=options)
    cache = tempfile.mkdtemp(prefix="relay-bench-digits-")

    def trainer():
        torch.manual_seed(0)
        model = DigitsCNN()
        return model, torch.optim.Adam(model.parameters(), lr=3e-3)

    def epoch_steps(loader, model, optimizer, epoch: int) -> list[float]:
        loader.set_epoch(epoch) if hasattr(loader, "set_epoch") else loader.sampler.set_epoch(epoch)
        out, last = [], time.perf_counter()
        for images, labels in loader:
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            now = time.perf_counter()
            out.append(now - last)
            last = now
        return out

    try:
        runs = {"memory": (rt.shard(train_set, batch_size=32, seed=0, rank=0, world_size=1), *trainer()),
                "store": (rt.stream(f"{url}/digits", batch_size=32, seed=0, shuffle_buffer=512, rank=0, world_size=1,
                                    cache_dir=cache, storage_options=options), *trainer())}
        times: dict[str, list[float]] = {"memory": [], "store": []}
        for epoch in range(epochs):  # interleaved, epoch by epoch: both see the same load
            for name, (loader, model, optimizer) in runs.items():
                steps = epoch_steps(loader, model, optimizer, epoch)
                if epoch:  # the first epoch fills the cache (and warms up): not counted
                    times[name] += steps
        memory, store = times["memory"], times["store"]
    finally:
        shutil.rmtree(cache)
    med_memory, med_store = statistics.median(memory), statistics.median(store)
    print(f"digits CNN, one process, epochs 2..{epochs}, median step: from memory {med_memory * 1e3:.2f} ms, "
          f"from the store {med_store * 1e3:.2f} ms, ratio {med_memory / med_store:.2f}")
    return {"train_from_store_step_ratio": med_memory / med_store, "memory_step_ms": med_memory * 1e3,
            "store_step_ms": med_store * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--data-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    versions = package_versions(("torch", "fsspec", "s3fs", "botocore"))
    print(header_line(versions))
    from services.ceph import CephCluster

    from torchrelay.storage import ArtifactStore

    reason = CephCluster.unavailable()
    if reason:
        sys.exit(f"no Ceph here: {reason}")
    cluster = CephCluster()
    try:
        print(f"Ceph {cluster.endpoint_url} up in {cluster.start_s:.1f} s; load average {os.getloadavg()[0]:.1f}")
        options = {"endpoint_url": cluster.endpoint_url, "region": cluster.region,
                   "access_key_id": cluster.access_key, "secret_access_key": cluster.secret_key}
        url = f"s3://{cluster.bucket}/{uuid.uuid4().hex[:8]}"
        store = ArtifactStore(url, options)
        result = bench_checkpoints(store, make_state(args.mb), args.rounds)
        result.update(bench_stream(store, url, options, args.data_mb, args.rounds))
        result.update(bench_digits(url, options, args.epochs))
        result["load_average"] = round(os.getloadavg()[0], 1)
    finally:
        cluster.stop()
    print(result_line({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}, versions))


if __name__ == "__main__":
    main()
