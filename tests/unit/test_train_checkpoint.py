"""torchrelay.train.checkpoint: commit by manifest, verification, fallback, safe unpickling."""
from __future__ import annotations

import io
import json
import os
import pickle

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import CheckpointCorrupt, NotFound, StorageError
from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import (LATEST, MANIFEST, STATE_FILE, CheckpointStore, build_manifest,
                                         decode_files, parse_step_dirname, step_dirname, verify)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "RELAY_JOB_ID", "RELAY_STORE_URL", "RELAY_JOB_STORE_PREFIX", "RELAY_STRATEGY",
                 "RELAY_CHECKPOINT", "RELAY_METRICS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(tmp_path / "out"))
    rt.shutdown()
    yield
    rt.shutdown()


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value), "b": torch.arange(3.0)}, "step": int(value),
            "note": "digits", "rng": torch.get_rng_state()}


def _encode(state) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


@pytest.fixture
def checkpoints(tmp_path) -> CheckpointStore:
    return CheckpointStore(ArtifactStore(str(tmp_path / "store")), "job1", keep=3)


def _path(checkpoints: CheckpointStore, *parts: str) -> str:
    return checkpoints.store.full_path(checkpoints.key(*parts))


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


def _files() -> dict[str, bytes]:
    return {"state.pt": b"abcdef", "extra.bin": b"\x00\x01"}


@pytest.mark.parametrize("damage, reason", [
    (lambda m, f: (m, {**f, "state.pt": b"abc"}), "has 3 bytes"),
    (lambda m, f: (m, {**f, "state.pt": b"abcdeX"}), "sha256"),
    (lambda m, f: (m, {"extra.bin": f["extra.bin"]}), "'state.pt' listed in MANIFEST.json is missing"),
    (lambda m, f: (b"{not json", f), "not a valid manifest"),
    (lambda m, f: (json.dumps({**json.loads(m), "step": 8}).encode(), f), "says step 8"),
    (lambda m, f: (json.dumps({**json.loads(m), "files": {}}).encode(), f), "not a valid manifest"),
    (lambda m, f: (json.dumps({**json.loads(m), "files": {"../x": {"sha256": "0", "size": 1}}}).encode(), f),
     "malformed"),
])
def test_verify_rejects_each_kind_of_damage(damage, reason):
    manifest = build_manifest(7, _files(), created=1.0)
    manifest, files = damage(manifest, _files())

    def read(name: str) -> bytes:
        if name not in files:
            raise NotFound(name)
        return files[name]

    with pytest.raises(CheckpointCorrupt, match=reason):
        verify("step-0000000007", manifest, read)


def test_verify_returns_files_of_a_good_checkpoint():
    manifest = build_manifest(7, _files(), created=1.0)
    assert verify("step-0000000007", manifest, _files().__getitem__) == _files()


# ---------------------------------------------------------------- store-backed


def test_save_then_load_round_trips_tensors(checkpoints):
    url = checkpoints.save({STATE_FILE: _encode(_state(1.0))}, 10)
    assert url.endswith("jobs/job1/checkpoints/step-0000000010")
    loaded = checkpoints.load(decode=decode_files)
    assert loaded.step == 10 and loaded.skipped == []
    assert torch.equal(loaded.state["model"]["w"], torch.full((4, 3), 1.0))
    assert loaded.state["note"] == "digits"
    assert checkpoints.latest_name() == "step-0000000010"


def test_manifest_is_written_last_and_latest_after_it(checkpoints, monkeypatch):
    order = []
    real_put = checkpoints.store.put_bytes
    monkeypatch.setattr(checkpoints.store, "put_bytes", lambda key, data: (order.append(key.rsplit("/", 1)[-1]),
                                                                            real_put(key, data)))
    checkpoints.save({"a.pt": b"1", "b.pt": b"2"}, 1)
    assert order == ["a.pt", "b.pt", MANIFEST, LATEST]


def test_keep_prunes_older_checkpoints(checkpoints):
    for step in range(1, 6):
        checkpoints.save({STATE_FILE: _encode(_state(step))}, step)
    assert sorted(checkpoints.folders()) == [3, 4, 5]
    assert checkpoints.latest_name() == "step-0000000005"


def test_saving_an_earlier_step_drops_the_abandoned_later_ones(checkpoints):
    for step in (1, 2, 3):
        checkpoints.save({STATE_FILE: _encode(_state(step))}, step)
    checkpoints.save({STATE_FILE: _encode(_state(20.0))}, 2)
    assert sorted(checkpoints.folders()) == [1, 2]
    loaded = checkpoints.load(decode=decode_files)
    assert loaded.step == 2 and loaded.state["step"] == 20


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
    (lambda c: _truncate(_path(c, "step-0000000002", STATE_FILE)), "truncated"),
    (lambda c: _flip_byte(_path(c, "step-0000000002", STATE_FILE)), "sha256"),
    (lambda c: os.remove(_path(c, "step-0000000002", STATE_FILE)), "missing"),
    (lambda c: os.remove(_path(c, "step-0000000002", MANIFEST)), "no MANIFEST.json"),
    (lambda c: _truncate(_path(c, "step-0000000002", MANIFEST)), "not a valid manifest"),
])
def test_a_damaged_checkpoint_is_rejected_and_the_previous_loaded(checkpoints, damage, reason, caplog):
    checkpoints.save({STATE_FILE: _encode(_state(1.0))}, 1)
    checkpoints.save({STATE_FILE: _encode(_state(2.0))}, 2)
    damage(checkpoints)
    with caplog.at_level("WARNING", logger="torchrelay.train.checkpoint"):
        loaded = checkpoints.load(decode=decode_files)
    assert loaded.step == 1
    assert torch.equal(loaded.state["model"]["w"], torch.full((4, 3), 1.0))
    assert [name for name, _ in loaded.skipped] == ["step-0000000002"]
    assert reason in loaded.skipped[0][1]
    assert "step-0000000002 skipped" in caplog.text and reason in caplog.text


def test_no_good_checkpoint_loads_as_none(checkpoints):
    assert checkpoints.load() is None
    checkpoints.save({STATE_FILE: _encode(_state(1.0))}, 1)
    _flip_byte(_path(checkpoints, "step-0000000001", STATE_FILE))
    assert checkpoints.load(decode=decode_files) is None


class _Evil:
    """Unpickling this would create ``marker`` (a visible side effect)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("encoding", ["torch.save zip", "raw pickle"])
def test_a_malicious_pickle_never_runs(checkpoints, tmp_path, encoding):
    marker = str(tmp_path / "pwned")
    evil = {"model": _Evil(marker)}
    data = _encode(evil) if encoding == "torch.save zip" else pickle.dumps(evil, protocol=2)
    checkpoints.save({STATE_FILE: _encode(_state(1.0))}, 1)
    checkpoints.save({STATE_FILE: data}, 2)  # checksums are right: only the unpickler can refuse it
    loaded = checkpoints.load(decode=decode_files)
    assert not os.path.exists(marker)
    assert loaded.step == 1
    assert "weights_only=True" in loaded.skipped[0][1]


class _FailingStore(ArtifactStore):
    """A real local store that fails the write of one file name, as a full disk would."""

    fail_name = MANIFEST

    def put_bytes(self, key: str, data: bytes) -> None:
        if key.rsplit("/", 1)[-1] == self.fail_name:
            raise StorageError(f"cannot write {self.url_of(key)}: no space left on device")
        super().put_bytes(key, data)


@pytest.mark.parametrize("fail_name", [STATE_FILE, MANIFEST, LATEST])
def test_a_failed_save_leaves_the_previous_checkpoint_loadable(tmp_path, fail_name):
    store = _FailingStore(str(tmp_path / "store"))
    checkpoints = CheckpointStore(store, "job1", keep=3)
    _FailingStore.fail_name = "nothing"
    checkpoints.save({STATE_FILE: _encode(_state(1.0))}, 1)
    _FailingStore.fail_name = fail_name
    with pytest.raises(StorageError, match="no space left"):
        checkpoints.save({STATE_FILE: _encode(_state(2.0))}, 2)
    assert checkpoints.latest_name() == "step-0000000001"
    loaded = checkpoints.load(decode=decode_files)
    # a manifest written before `latest` failed is a complete commit: loading trusts manifests
    assert loaded.step == (2 if fail_name == LATEST else 1)
    leftovers = [name for _dirpath, _dirs, names in os.walk(tmp_path / "store") for name in names if ".tmp-" in name]
    assert leftovers == []


# ---------------------------------------------------------------- the job-level functions


def test_save_and_load_checkpoint_in_the_local_output_folder(tmp_path):
    assert rt.load_checkpoint() is None
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    url = rt.save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, 5)
    assert url == str(tmp_path / "out" / "jobs" / "local" / "checkpoints" / "step-0000000005")
    state, step = rt.load_checkpoint()
    assert step == 5
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.weight, model.weight)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    fresh_opt.load_state_dict(state["optimizer"])
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


def test_only_the_main_rank_writes(tmp_path, monkeypatch):
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
