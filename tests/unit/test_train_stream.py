"""rt.stream over shards packed into a local folder: exactly once, resumable, refusals; relay data pack."""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import InvalidSpec, NotFound
from torchrelay.shards import pack

pytestmark = pytest.mark.timeout(60)
N = 203  # not a multiple of anything used below


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("data") / "ids")
    pack({"x": torch.arange(N, dtype=torch.float32).unsqueeze(1).repeat(1, 4), "id": torch.arange(N)}, url,
         shard_size=16 * 24)  # 24 bytes a sample: 16 per shard, 13 shards
    return url


def ids_of(loader) -> list[int]:
    out = []
    for batch in loader:
        assert torch.equal(batch["x"][:, 0].long(), batch["id"])  # fields of one sample stay together
        out += batch["id"].tolist()
    return out


@pytest.mark.parametrize("world, buffer, shuffle", [(1, 0, False), (3, 32, True), (4, 1, True), (5, 1000, True)])
def test_every_sample_once_per_epoch_across_ranks(dataset, world, buffer, shuffle):
    orders = {}
    for epoch in (0, 1):
        seen = Counter()
        for rank in range(world):
            loader = rt.stream(dataset, batch_size=8, shuffle=shuffle, shuffle_buffer=buffer, rank=rank,
                               world_size=world)
            loader.set_epoch(epoch)
            ids = ids_of(loader)
            assert len(loader) == -(-len(ids) // 8)
            seen.update(ids)
            orders[epoch, rank] = ids
        assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    if shuffle:
        assert orders[0, 0] != orders[1, 0]  # another epoch, another order
    else:
        assert orders[0, 0] == list(range(N))


def test_even_gives_every_rank_the_same_steps(dataset):
    lengths = {len(rt.stream(dataset, batch_size=5, even=True, rank=r, world_size=4)) for r in range(4)}
    assert lengths == {-(-(N // 4) // 5)}
    total = sum(len(ids_of(rt.stream(dataset, batch_size=5, even=True, rank=r, world_size=4))) for r in range(4))
    assert total == N - N % 4


def test_resuming_from_state_dict_continues_exactly(dataset):
    whole = rt.stream(dataset, batch_size=7, shuffle_buffer=40, seed=5, rank=1, world_size=2)
    whole.set_epoch(3)
    expected = ids_of(whole)
    first = rt.stream(dataset, batch_size=7, shuffle_buffer=40, seed=5, rank=1, world_size=2)
    first.set_epoch(3)
    head = []
    for batch in first:
        head += batch["id"].tolist()
        if len(head) >= 35:
            break
    saved = first.state_dict()
    assert saved["epoch"] == 3 and saved["samples"] == 35
    second = rt.stream(dataset, batch_size=7, shuffle_buffer=40, seed=5, rank=1, world_size=2)
    second.load_state_dict(saved)
    second.set_epoch(3)  # TrainState.epochs() does this: the same epoch stays where it is
    assert head + ids_of(second) == expected
    second.set_epoch(4)
    assert second.state_dict()["samples"] == 0


@pytest.mark.parametrize("change", [{"seed": 6}, {"world_size": 3}, {"shuffle_buffer": 41}, {"batch_size": 8}])
def test_a_position_of_another_plan_is_refused(dataset, change):
    base = {"batch_size": 7, "shuffle_buffer": 40, "seed": 5, "rank": 1, "world_size": 2}
    saved = rt.stream(dataset, **base).state_dict()
    with pytest.raises(ValueError, match="repeat or skip"):
        rt.stream(dataset, **{**base, **change}).load_state_dict(saved)


def test_train_state_resumes_a_stream_without_replaying_it(dataset, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(tmp_path / "out"))
    for name in ("RELAY_JOB_ID", "RELAY_STORE_URL", "RELAY_JOB_STORE_PREFIX", "RELAY_CHECKPOINT", "RANK",
                 "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def run(stop_at=None):
        model = torch.nn.Linear(4, 1)
        state = rt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.0),
                              rt.stream(dataset, batch_size=10, shuffle_buffer=20, rank=0, world_size=1))
        state.restore()
        ids = []
        for _epoch in state.epochs(2):
            for batch in state.batches():
                ids.append(batch["id"].tolist())
                if state.step == stop_at:
                    state.save(async_=False)
                    return ids, state
        return ids, state

    rt.init()
    try:
        whole, _ = run()
        import shutil
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        head, _ = run(stop_at=27)  # 21 steps an epoch: mid-way through the second
        tail, state = run()
        assert head + tail == whole and state.step == 42
    finally:
        rt.shutdown()


def test_a_folder_without_an_index_is_refused(tmp_path):
    (tmp_path / "shard-000000.pt").write_bytes(b"x")
    with pytest.raises(NotFound, match="index.json"):
        rt.stream(str(tmp_path), batch_size=1)
    (tmp_path / "index.json").write_text("{}")
    with pytest.raises(InvalidSpec, match="not a shard index"):
        rt.stream(str(tmp_path), batch_size=1)


def test_pack_from_samples_and_tuples(tmp_path):
    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.full((2,), float(i)), i

    index = pack(Samples(), str(tmp_path / "tuples"), shard_size=20)  # 16 bytes a sample: 1 per shard
    assert index.kind == "tuple" and index.samples == 10 and len(index.shards) == 10
    batches = list(rt.stream(str(tmp_path / "tuples"), batch_size=4, shuffle=False, rank=0, world_size=1))
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert torch.equal(batches[0][0][:, 0], torch.tensor([0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="fields"):
        pack([{"a": 1}, {"b": 2}], str(tmp_path / "bad"))


def test_relay_data_pack(tmp_path):
    import numpy as np

    np.savez(tmp_path / "src.npz", x=np.ones((50, 3), dtype=np.float32), y=np.arange(50))
    done = subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", "data", "pack", str(tmp_path / "src.npz"),
                           str(tmp_path / "dest"), "--shard-size", "256B", "-o", "json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"samples": 50' in done.stdout and '"shards": 5' in done.stdout
    assert sorted(ids for b in rt.stream(str(tmp_path / "dest"), batch_size=8, rank=0, world_size=1)
                  for ids in b["y"].tolist()) == list(range(50))
