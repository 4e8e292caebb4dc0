"""torchrelay.train.checkpoint: DCP checkpoints committed by a manifest, verified, with fallback; async saves."""
from __future__ import annotations

import json
import os
import pickle
import threading

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import CheckpointCorrupt, StaleAttempt, StorageError
from torchrelay.storage import ArtifactStore
from torchrelay.train import checkpoint as ckpt
from torchrelay.train import checkpoint_dcp
from torchrelay.train.checkpoint import (LATEST, MANIFEST, CheckpointStore, build_manifest, check_file,
                                         decode_files, decode_int_keys, encode_int_keys, parse_manifest,
                                         parse_step_dirname, step_dirname)
from torchrelay.train.checkpoint_dcp import METADATA_FILE, file_count, load_metadata, split_into_files

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RELAY_JOB_ID", "RELAY_STORE_URL", "RELAY_JOB_STORE_PREFIX", "RELAY_STRATEGY",
                 "RELAY_CHECKPOINT", "RELAY_METRICS_DIR", "RELAY_ATTEMPT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(tmp_path / "out"))
    rt.shutdown()
    yield
    try:
        rt.wait_for_checkpoint()
    finally:
        rt.shutdown()


def _state(value: float) -> dict:
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    with torch.no_grad():
        model.weight.fill_(value)
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": int(value),
            "note": "digits", "rng": torch.get_rng_state(), "half": torch.full((5,), value, dtype=torch.bfloat16),
            "empty": torch.empty(0, 3), "ints": torch.arange(7)}


@pytest.fixture
def checkpoints(tmp_path) -> CheckpointStore:
    return CheckpointStore(ArtifactStore(str(tmp_path / "store")), "job1", keep=3)


def _path(checkpoints: CheckpointStore, *parts: str) -> str:
    return checkpoints.store.full_path(checkpoints.key(*parts))


def _load(checkpoints: CheckpointStore):
    return checkpoints.load(decode=decode_files)


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("step, name", [(0, "step-0000000000"), (42, "step-0000000042"),
                                        (12345678901, "step-12345678901")])
def test_step_dirname_round_trips(step, name):
    assert step_dirname(step) == name
    assert parse_step_dirname(name) == step


@pytest.mark.parametrize("name", ["latest", "step-12", "step-00000000x1", "MANIFEST.json", "step-0000000001.tmp-ab"])
def test_parse_step_dirname_ignores_other_names(name):
    assert parse_step_dirname(name) is None


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_step_dirname_refuses_bad_steps(step):
    with pytest.raises(ValueError, match="step="):
        step_dirname(step)


_ENTRIES = {"__0_0.distcp": {"sha256": "ab" * 32, "size": 6}, ".metadata": {"sha256": "cd" * 32, "size": 2}}


def _manifest_with(**changes) -> bytes:
    return json.dumps({**json.loads(build_manifest(7, _ENTRIES, created=1.0)), **changes}).encode()


@pytest.mark.parametrize("manifest, reason", [
    (b"{not json", "not a valid manifest"),
    (_manifest_with(step=8), "says step 8"),
    (_manifest_with(files={}), "not a valid manifest"),
    (_manifest_with(format="torchrelay-checkpoint/1"), "not a valid manifest"),
    (_manifest_with(files={"../x": {"sha256": "0", "size": 1}}), "malformed"),
    (_manifest_with(files={"a/b": {"sha256": "0", "size": 1}}), "malformed"),
    (_manifest_with(files={"x": {"sha256": "0"}}), "malformed"),
])
def test_parse_manifest_rejects_each_kind_of_damage(manifest, reason):
    with pytest.raises(CheckpointCorrupt, match=reason):
        parse_manifest("step-0000000007", manifest)


def test_parse_manifest_returns_every_file():
    assert parse_manifest("step-0000000007", build_manifest(7, _ENTRIES, created=1.0)) == {
        "__0_0.distcp": ("ab" * 32, 6), ".metadata": ("cd" * 32, 2)}


@pytest.mark.parametrize("actual, reason", [
    (("ab" * 32, 6), None),
    (None, "missing"),
    (("ab" * 32, 3), "has 3 bytes"),
    (("ef" * 32, 6), "sha256 efefef"),
])
def test_check_file_names_the_mismatch(actual, reason):
    result = check_file("f", ("ab" * 32, 6), actual)
    assert result is None if reason is None else reason in result


@pytest.mark.parametrize("state, paths", [
    ({"a": 1}, []),
    ({"opt": {"state": {0: {"m": 1}, 1: {"m": 2}}}}, [("opt", "state")]),
    ({0: {1: "x"}}, [(), ("0",)]),
    ({"groups": [{"params": [0, 1]}, {3: 4}]}, [("groups", 1)]),
])
def test_int_keys_round_trip(state, paths):
    encoded, found = encode_int_keys(state)
    assert found == paths
    assert all(isinstance(k, str) for k in encoded)
    assert decode_int_keys(encoded, found) == state


@pytest.mark.parametrize("state, match", [({(1, 2): 0}, "must be a str or an int"), ({1: 0, "1": 0}, "collide")])
def test_encode_int_keys_refuses_what_it_cannot_round_trip(state, match):
    with pytest.raises(ValueError, match=match):
        encode_int_keys(state)


def _write_item(name: str, nbytes: int):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    if nbytes == 0:
        return WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
    size = torch.Size([nbytes // 4])
    return WriteItem(index=MetadataIndex(name), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([0]), size),
                                                 properties=TensorProperties(dtype=torch.float32), size=size))


@pytest.mark.parametrize("sizes, files, expected", [
    ([400, 300, 200, 100], 2, [["t0", "t3"], ["t1", "t2"]]),
    ([400, 0, 0], 4, [["b1", "t0"], ["b2"]]),
    ([100], 4, [["t0"]]),
    ([], 3, []),
])
def test_split_into_files_balances_bytes(sizes, files, expected):
    items = [_write_item(f"{'t' if n else 'b'}{i}", n) for i, n in enumerate(sizes)]
    groups = split_into_files(items, files)
    assert [sorted(i.index.fqn for i in g) for g in groups] == [sorted(g) for g in expected]


@pytest.mark.parametrize("total, threads, limit, expected", [
    (0, 4, 64, 4),          # never fewer than threads
    (210, 4, 64, 4),        # 4 files of ~52: each under the limit
    (257, 4, 64, 5),        # one more file keeps each near the limit
    (10_000, 4, 64, 157),
    (64, 1, 64, 1),
])
def test_file_count_bounds_the_size_of_each_file(total, threads, limit, expected):
    assert file_count(total, threads, limit) == expected


def test_run_in_threads_keeps_order_and_the_limit():
    running, most = [0], [0]
    lock = threading.Lock()

    def call(n):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        threading.Event().wait(0.01)
        with lock:
            running[0] -= 1
        return n

    assert checkpoint_dcp._run_in_threads([lambda n=n: call(n) for n in range(9)], limit=3) == list(range(9))
    assert most[0] <= 3
    with pytest.raises(ZeroDivisionError):
        checkpoint_dcp._run_in_threads([lambda: 1 // 0, lambda: 2], limit=1)


class _Evil:
    """Unpickling this would create ``marker`` (a visible side effect)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_metadata_unpickler_refuses_anything_but_dcp_metadata(tmp_path):
    marker = str(tmp_path / "pwned")
    with pytest.raises(CheckpointCorrupt, match="posix.mkdir is not allowed"):
        load_metadata(pickle.dumps(_Evil(marker)))
    assert not os.path.exists(marker)
    with pytest.raises(CheckpointCorrupt, match="not DCP metadata"):
        load_metadata(pickle.dumps({"storage_data": {}}))


# ---------------------------------------------------------------- store-backed


def _assert_state_equal(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        elif isinstance(value, dict):
            _assert_state_equal(loaded[key], value)
        else:
            assert loaded[key] == value, key


def test_save_then_load_round_trips_every_kind_of_value(checkpoints):
    state = _state(1.0)
    url = checkpoints.save(state, 10)
    assert url.endswith("jobs/job1/checkpoints/step-0000000010")
    loaded = _load(checkpoints)
    assert loaded.step == 10 and loaded.skipped == []
    _assert_state_equal(loaded.state, state)
    assert checkpoints.latest_name() == "step-0000000010"
    model = torch.nn.Linear(3, 4)
    optimizer = torch.optim.Adam(model.parameters())
    model.load_state_dict(loaded.state["model"])
    optimizer.load_state_dict(loaded.state["optimizer"])  # int parameter keys came back as ints
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


def test_the_manifest_lists_every_file_and_is_written_last_then_latest(checkpoints, monkeypatch):
    order = []
    real_put, real_put_if_absent = checkpoints.store.put_bytes, checkpoints.store.put_if_absent
    monkeypatch.setattr(checkpoints.store, "put_bytes",
                        lambda key, data: (order.append(key.rsplit("/", 1)[-1]), real_put(key, data)))
    monkeypatch.setattr(checkpoints.store, "put_if_absent",  # the manifest: never over another writer's
                        lambda key, data: (order.append(key.rsplit("/", 1)[-1]), real_put_if_absent(key, data))[1])
    checkpoints.save(_state(1.0), 1)
    assert order == [METADATA_FILE, MANIFEST, LATEST]
    folder = _path(checkpoints, "step-0000000001")
    manifest = json.loads(open(os.path.join(folder, MANIFEST), "rb").read())
    assert sorted(manifest["files"]) == sorted(set(os.listdir(folder)) - {MANIFEST})
    assert any(name.endswith(".distcp") for name in manifest["files"])


def test_keep_prunes_older_checkpoints(checkpoints):
    for step in range(1, 6):
        checkpoints.save({"x": torch.ones(2) * step}, step)
    assert sorted(checkpoints.folders()) == [3, 4, 5]
    assert checkpoints.latest_name() == "step-0000000005"


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(checkpoints):
    for step in (1, 2, 3):
        checkpoints.save({"x": torch.ones(2) * step}, step)
    checkpoints.save({"x": torch.ones(2) * 20}, 2)
    assert sorted(checkpoints.folders()) == [1, 2]
    loaded = _load(checkpoints)
    assert loaded.step == 2 and torch.equal(loaded.state["x"], torch.ones(2) * 20)


def _data_file(checkpoints: CheckpointStore, name: str = "step-0000000002") -> str:
    folder = _path(checkpoints, name)
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))
    return os.path.join(folder, max(shards, key=lambda f: os.path.getsize(os.path.join(folder, f))))


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _flip_byte(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("damage, reason", [
    (lambda c: _truncate(_data_file(c)), "truncated"),
    (lambda c: _flip_byte(_data_file(c)), "sha256"),
    (lambda c: os.remove(_data_file(c)), "missing"),
    (lambda c: os.remove(_path(c, "step-0000000002", METADATA_FILE)), "'.metadata' listed in MANIFEST.json is missing"),
    (lambda c: os.remove(_path(c, "step-0000000002", MANIFEST)), "no MANIFEST.json"),
    (lambda c: _truncate(_path(c, "step-0000000002", MANIFEST)), "not a valid manifest"),
])
def test_a_damaged_checkpoint_is_rejected_and_the_previous_loaded(checkpoints, damage, reason, caplog):
    checkpoints.save(_state(1.0), 1)
    checkpoints.save(_state(2.0), 2)
    damage(checkpoints)
    with caplog.at_level("WARNING", logger="torchrelay.train.checkpoint"):
        loaded = _load(checkpoints)
    assert loaded.step == 1
    assert torch.equal(loaded.state["model"]["weight"], torch.full((4, 3), 1.0))
    assert [name for name, _ in loaded.skipped] == ["step-0000000002"]
    assert reason in loaded.skipped[0][1]
    assert "step-0000000002 skipped" in caplog.text and reason in caplog.text


def test_no_good_checkpoint_loads_as_none(checkpoints):
    assert checkpoints.load() is None
    checkpoints.save(_state(1.0), 1)
    _flip_byte(_data_file(checkpoints, "step-0000000001"))
    assert _load(checkpoints) is None


def _recommit(checkpoints: CheckpointStore, name: str) -> None:
    """Rewrite the manifest so that every checksum matches what is on disk (as an attacker could)."""
    folder = _path(checkpoints, name)
    entries = {f: checkpoint_dcp.digest_entry(open(os.path.join(folder, f), "rb").read())
               for f in os.listdir(folder) if f != MANIFEST}
    with open(os.path.join(folder, MANIFEST), "wb") as fh:
        fh.write(build_manifest(parse_step_dirname(name), entries, created=1.0))


def test_a_malicious_pickle_in_a_value_never_runs(checkpoints, tmp_path, monkeypatch):
    marker = str(tmp_path / "pwned")
    checkpoints.save(_state(1.0), 1)
    # torch.save of the planner's own byte values is where a pickle lives in a DCP checkpoint
    checkpoints.save({"x": torch.ones(1), "evil": _Evil(marker)}, 2)
    assert not os.path.exists(marker)
    loaded = _load(checkpoints)
    assert not os.path.exists(marker)
    assert loaded.step == 1
    assert "weights_only=True" in loaded.skipped[0][1] and "'evil'" in loaded.skipped[0][1]


def test_a_malicious_pickle_in_the_metadata_never_runs(checkpoints, tmp_path):
    marker = str(tmp_path / "pwned")
    checkpoints.save(_state(1.0), 1)
    checkpoints.save(_state(2.0), 2)
    with open(_path(checkpoints, "step-0000000002", METADATA_FILE), "wb") as fh:
        fh.write(pickle.dumps(_Evil(marker)))
    _recommit(checkpoints, "step-0000000002")
    loaded = _load(checkpoints)
    assert not os.path.exists(marker)
    assert loaded.step == 1 and "is not allowed in checkpoint metadata" in loaded.skipped[0][1]


# ---------------------------------------------------------------- full disk, read-only store (real mounts)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (root only), unmounted in teardown."""
    import subprocess

    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_full_disk_leaves_the_previous_checkpoint_loadable(small_tmpfs):
    checkpoints = CheckpointStore(ArtifactStore(str(small_tmpfs)), "job1", keep=3)
    checkpoints.save({"x": torch.ones(1000)}, 1)  # 4 kB
    with pytest.raises(StorageError, match="step 2 .* no space left on device"):
        checkpoints.save({"x": torch.ones(2_000_000)}, 2)  # 8 MB into 1 MiB
    assert checkpoints.latest_name() == "step-0000000001"
    assert sorted(checkpoints.folders()) == [1]  # the failed attempt's files are gone: space is back
    loaded = _load(checkpoints)
    assert loaded.step == 1 and torch.equal(loaded.state["x"], torch.ones(1000))
    checkpoints.save({"x": torch.ones(1000) * 3}, 3)  # and the next save fits again
    assert _load(checkpoints).step == 3


def test_a_read_only_store_raises_a_clear_error_and_keeps_the_previous(small_tmpfs):
    import subprocess

    checkpoints = CheckpointStore(ArtifactStore(str(small_tmpfs)), "job1", keep=3)
    checkpoints.save({"x": torch.ones(10)}, 1)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(StorageError, match="step 2 .*(not writable|Read-only)"):
        checkpoints.save({"x": torch.ones(10) * 2}, 2)
    loaded = _load(checkpoints)
    assert loaded.step == 1 and torch.equal(loaded.state["x"], torch.ones(10))


# ---------------------------------------------------------------- the job-level functions


def test_save_and_load_checkpoint_in_the_local_output_folder(tmp_path):
    assert rt.load_checkpoint() is None
    state = _state(5.0)
    url = rt.save_checkpoint(state, 5)
    assert url == str(tmp_path / "out" / "jobs" / "local" / "checkpoints" / "step-0000000005")
    loaded, step = rt.load_checkpoint()
    assert step == 5
    _assert_state_equal(loaded, state)


def test_without_a_process_group_only_the_main_rank_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    url = rt.save_checkpoint({"x": torch.ones(1)}, 3)
    assert url.endswith("step-0000000003")
    assert not os.path.exists(tmp_path / "out" / "jobs" / "local" / "checkpoints")


def test_policy_from_the_environment_sets_keep_and_due_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_CHECKPOINT", json.dumps({"every_steps": 4, "keep": 2}))
    assert [s for s in range(0, 13) if rt.checkpoint_due(s)] == [4, 8, 12]
    for step in (4, 8, 12):
        rt.save_checkpoint({"x": torch.ones(1) * step}, step)
    folders = sorted(os.listdir(tmp_path / "out" / "jobs" / "local" / "checkpoints"))
    assert folders == ["latest", "step-0000000008", "step-0000000012"]


def test_checkpoints_go_to_the_job_store_when_run_as_a_job(tmp_path, monkeypatch):
    store_dir = tmp_path / "cluster-store"
    monkeypatch.setenv("RELAY_STORE_URL", f"file://{store_dir}")
    monkeypatch.setenv("RELAY_JOB_ID", "j-42")
    monkeypatch.setenv("RELAY_JOB_STORE_PREFIX", "jobs/j-42")
    url = rt.save_checkpoint({"x": torch.zeros(2)}, 1)
    assert url == f"file://{store_dir}/jobs/j-42/checkpoints/step-0000000001"
    assert os.path.exists(store_dir / "jobs" / "j-42" / "checkpoints" / "step-0000000001" / MANIFEST)


def _fence(store: ArtifactStore, job_id: str, attempt: int) -> None:
    store.put_bytes(ArtifactStore.attempt_key(job_id), str(attempt).encode())


@pytest.mark.parametrize("stale_step", [5, 10, 20])  # older, same and newer step than the new attempt's
def test_a_replaced_attempt_cannot_overwrite_commit_or_prune_the_new_attempts_checkpoints(tmp_path, stale_step):
    store = ArtifactStore(f"file://{tmp_path}")
    _fence(store, "job1", 1)
    old = CheckpointStore(store, "job1", keep=2, attempt=1)
    old.save({"x": torch.ones(2)}, 5)
    _fence(store, "job1", 2)  # the server placed attempt 2 (attempt 1's node lost contact)
    new = CheckpointStore(store, "job1", keep=2, attempt=2)
    new.save({"x": torch.ones(2) * 2}, 10)
    with pytest.raises(StaleAttempt, match=r"step %d of job1.*attempt 1.*attempt 2" % stale_step):
        old.save({"x": torch.ones(2) * -1}, stale_step)
    assert new.latest_name() == "step-0000000010"
    assert {step: ok for step, ok in new.folders().items() if ok} == {5: True, 10: True}
    loaded = _load(new)
    assert loaded.step == 10 and torch.equal(loaded.state["x"], torch.ones(2) * 2)


def test_the_current_attempt_and_a_store_without_a_fence_save_as_usual(tmp_path):
    store = ArtifactStore(f"file://{tmp_path}")
    CheckpointStore(store, "job1", attempt=0).save({"x": torch.ones(1)}, 1)  # no fence written yet
    _fence(store, "job1", 3)
    CheckpointStore(store, "job1", attempt=3).save({"x": torch.ones(1)}, 2)
    CheckpointStore(store, "job1").save({"x": torch.ones(1)}, 3)  # no attempt: not fenced
    assert CheckpointStore(store, "job1").latest_name() == "step-0000000003"


@pytest.mark.parametrize("async_", [False, True])
def test_a_job_worker_of_a_replaced_attempt_gets_stale_attempt(tmp_path, monkeypatch, async_):
    store_dir = tmp_path / "cluster-store"
    monkeypatch.setenv("RELAY_STORE_URL", f"file://{store_dir}")
    monkeypatch.setenv("RELAY_JOB_ID", "j-7")
    monkeypatch.setenv("RELAY_JOB_STORE_PREFIX", "jobs/j-7")
    monkeypatch.setenv("RELAY_ATTEMPT", "1")
    _fence(ArtifactStore(f"file://{store_dir}"), "j-7", 1)
    rt.save_checkpoint({"x": torch.zeros(2)}, 1, async_=async_)
    rt.wait_for_checkpoint()
    _fence(ArtifactStore(f"file://{store_dir}"), "j-7", 2)
    with pytest.raises(StaleAttempt, match="attempt 1"):
        rt.save_checkpoint({"x": torch.ones(2)}, 2, async_=async_)
        rt.wait_for_checkpoint()
    assert (store_dir / "jobs" / "j-7" / "checkpoints" / LATEST).read_text() == "step-0000000001"


# ---------------------------------------------------------------- async


class _Gate:
    """Holds every checkpoint file write until opened; counts saves writing at once."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.lock = threading.Lock()
        self.writing_saves: set[str] = set()
        self.most_at_once = 0
        real = checkpoint_dcp.StoreWriter._write_file

        def gated(writer, name, items, planner):
            with self.lock:
                self.writing_saves.add(writer.folder)
                self.most_at_once = max(self.most_at_once, len(self.writing_saves))
            assert self.open.wait(30), "the test never opened the gate"
            try:
                return real(writer, name, items, planner)
            finally:
                with self.lock:
                    self.writing_saves.discard(writer.folder)

        monkeypatch.setattr(checkpoint_dcp.StoreWriter, "_write_file", gated)


def test_an_async_save_returns_before_its_bytes_are_written_and_only_one_is_in_flight(tmp_path, monkeypatch):
    rt.save_checkpoint({"x": torch.zeros(4)}, 1)
    gate = _Gate(monkeypatch)
    url = rt.save_checkpoint({"x": torch.ones(4)}, 2, async_=True)  # returns although no byte can be written
    checkpoints = ckpt.job_checkpoints()
    assert url.endswith("step-0000000002") and checkpoints.latest_name() == "step-0000000001"

    second_returned = threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            rt.save_checkpoint({"x": torch.full((4,), 3.0)}, 3, async_=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        second_returned.set()

    thread = threading.Thread(target=second)
    thread.start()
    assert not second_returned.wait(0.5), "a second save started while the first was in flight"
    assert checkpoints.latest_name() == "step-0000000001"
    gate.open.set()
    assert second_returned.wait(30) and not errors
    thread.join()
    assert rt.wait_for_checkpoint() == url.replace("step-0000000002", "step-0000000003")
    assert gate.most_at_once == 1
    assert checkpoints.latest_name() == "step-0000000003"
    state, step = rt.load_checkpoint()
    assert step == 3 and torch.equal(state["x"], torch.full((4,), 3.0))
    assert sorted(checkpoints.folders()) == [1, 2, 3]


def test_an_async_save_holds_the_state_of_its_call_although_training_goes_on(tmp_path, monkeypatch):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gate = _Gate(monkeypatch)
    rt.save_checkpoint({"model": model.state_dict()}, 1, async_=True, guard=[model, optimizer])
    model(torch.ones(1, 3)).sum().backward()  # forward waits for the copy, not for the write
    optimizer.step()                           # changes the live tensors while the save is in flight
    assert not torch.equal(model.weight, before["weight"])
    gate.open.set()
    rt.wait_for_checkpoint()
    state, _ = rt.load_checkpoint()
    assert torch.equal(state["model"]["weight"], before["weight"]) and torch.equal(state["model"]["bias"],
                                                                                    before["bias"])


def test_a_failed_async_save_is_raised_by_the_next_wait(small_tmpfs, monkeypatch):
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(small_tmpfs))
    rt.save_checkpoint({"x": torch.ones(10)}, 1)
    rt.save_checkpoint({"x": torch.ones(2_000_000)}, 2, async_=True)
    with pytest.raises(StorageError, match="step 2 .* no space left on device"):
        rt.wait_for_checkpoint()
    state, step = rt.load_checkpoint()
    assert step == 1 and torch.equal(state["x"], torch.ones(10))


def test_an_async_save_in_flight_when_the_script_ends_is_still_committed(tmp_path):
    import subprocess
    import sys

    script = ("import torch, torchrelay.train as rt\n"
              "rt.save_checkpoint({'x': torch.ones(3)}, 1)\n"
              "rt.save_checkpoint({'x': torch.full((1_000_000,), 2.0)}, 2, async_=True)\n")  # no wait: exits
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RELAY_OUTPUT_DIR": str(tmp_path / "out")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "failed" not in done.stderr, done.stderr[-2000:]
    state, step = rt.load_checkpoint()
    assert step == 2 and torch.equal(state["x"], torch.full((1_000_000,), 2.0))


def test_an_async_save_of_a_model_with_buffers_holds_the_statistics_of_its_call(monkeypatch):
    model = torch.nn.BatchNorm1d(3)
    before = model.running_mean.clone()
    gate = _Gate(monkeypatch)
    rt.save_checkpoint({"model": model.state_dict()}, 1, async_=True, guard=[model])
    model(torch.randn(8, 3) + 5.0)  # train-mode forward changes running_mean: it waits for the copy first
    assert not torch.equal(model.running_mean, before)
    gate.open.set()
    rt.wait_for_checkpoint()
    state, _ = rt.load_checkpoint()
    assert torch.equal(state["model"]["running_mean"], before)


def test_empty_dicts_come_back(checkpoints):
    """DCP's flattening drops empty dicts; an optimizer without momentum has ``state: {}``, which
    ``load_state_dict`` needs back."""
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoints.save({"optimizer": optimizer.state_dict(), "nested": {"a": {}, "b": [{}, {"c": {}}]}}, 1)
    state = _load(checkpoints).state
    assert state["optimizer"]["state"] == {} and state["nested"]["a"] == {} and state["nested"]["b"][1]["c"] == {}
    torch.optim.SGD(model.parameters(), lr=0.1).load_state_dict(state["optimizer"])
