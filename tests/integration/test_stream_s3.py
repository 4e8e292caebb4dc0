"""rt.stream from a real Ceph bucket (tests/services/ceph.py): fetched, verified and cached on disk.

After one epoch every shard the rank read is in the cache, named by its sha256; with the S3
gateway stopped, the next epoch still streams (from the cache alone); a shard changed in the
bucket after packing is refused naming its URL.
"""
from __future__ import annotations

import uuid

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import StorageError
from torchrelay.shards import pack
from torchrelay.storage import ArtifactStore

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow  # the gateway stopped and started again: make test-all
def test_a_stream_from_s3_is_cached_and_verified(ceph, tmp_path):
    options = {"endpoint_url": ceph.endpoint_url, "region": ceph.region, "access_key_id": ceph.access_key,
               "secret_access_key": ceph.secret_key}
    url = f"s3://{ceph.bucket}/{uuid.uuid4().hex[:12]}/ids"
    index = pack({"id": torch.arange(100)}, url, shard_size=80, storage_options=options)  # 10 shards
    cache = tmp_path / "cache"

    def epoch(n: int) -> list[int]:
        loader = rt.stream(url, batch_size=16, rank=0, world_size=1, cache_dir=str(cache), storage_options=options)
        loader.set_epoch(n)
        return [i for batch in loader for i in batch["id"].tolist()]

    assert sorted(epoch(0)) == list(range(100))
    assert sorted(p.name for p in cache.iterdir()) == sorted(f"{s.sha256}.pt" for s in index.shards)
    loader = rt.stream(url, batch_size=16, rank=0, world_size=1, cache_dir=str(cache), storage_options=options)
    ceph.stop_gateway()
    try:
        loader.set_epoch(1)
        assert sorted(i for batch in loader for i in batch["id"].tolist()) == list(range(100))
    finally:
        ceph.start_gateway()

    store = ArtifactStore(url, options)
    first = index.shards[0]
    store.put_bytes(first.name, store.get_bytes(index.shards[1].name))  # changed after packing
    with pytest.raises(StorageError, match=f"{first.name} has sha256"):
        list(rt.stream(url, batch_size=16, rank=0, world_size=1, shuffle=False,
                       cache_dir=str(tmp_path / "fresh"), storage_options=options))
