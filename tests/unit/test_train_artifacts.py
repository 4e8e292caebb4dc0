"""torchrelay.train.artifacts: where artifacts go, and what save_artifact accepts."""
from __future__ import annotations

import io
import os

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import InvalidPath, InvalidSpec, StorageError
from torchrelay.train.artifacts import store_location

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("env, expected", [
    ({"RELAY_OUTPUT_DIR": "/data/out"}, ("/data/out", "local")),
    ({"RELAY_STORE_URL": "s3://bucket/relay", "RELAY_JOB_ID": "j1", "RELAY_JOB_STORE_PREFIX": "jobs/j1"},
     ("s3://bucket/relay", "j1")),
    ({"RELAY_STORE_URL": "file:///srv/store", "RELAY_JOB_ID": "j2"}, ("file:///srv/store", "j2")),
    ({}, (os.path.abspath("relay-outputs"), "local")),
])
def test_store_location(env, expected):
    assert store_location(env) == expected


def test_store_location_refuses_a_prefix_that_disagrees_with_the_job():
    with pytest.raises(InvalidSpec, match="RELAY_JOB_STORE_PREFIX='jobs/other' does not match RELAY_JOB_ID='j1'"):
        store_location({"RELAY_STORE_URL": "/x", "RELAY_JOB_ID": "j1", "RELAY_JOB_STORE_PREFIX": "jobs/other"})


@pytest.fixture
def out(tmp_path, monkeypatch):
    for name in ("RELAY_STORE_URL", "RELAY_JOB_ID", "RELAY_JOB_STORE_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RELAY_OUTPUT_DIR", str(tmp_path / "out"))
    return tmp_path / "out" / "jobs" / "local" / "artifacts"


def test_save_artifact_bytes_tensors_files_and_folders(out, tmp_path):
    assert rt.save_artifact("raw.bin", b"\x00\x01") == str(out / "raw.bin")
    assert (out / "raw.bin").read_bytes() == b"\x00\x01"

    state = {"w": torch.arange(6.0).reshape(2, 3)}
    url = rt.save_artifact("models/model.pt", state)
    assert url == rt.artifact_url("models/model.pt") == str(out / "models" / "model.pt")
    loaded = torch.load(io.BytesIO((out / "models" / "model.pt").read_bytes()), weights_only=True)
    assert torch.equal(loaded["w"], state["w"])

    local = tmp_path / "result.txt"
    local.write_text("accuracy 0.97\n")
    rt.save_artifact("result.txt", str(local))
    assert (out / "result.txt").read_text() == "accuracy 0.97\n"

    folder = tmp_path / "tb"
    (folder / "run1").mkdir(parents=True)
    (folder / "run1" / "events").write_bytes(b"e1")
    (folder / "top").write_bytes(b"t")
    rt.save_artifact("tensorboard", folder)
    assert (out / "tensorboard" / "run1" / "events").read_bytes() == b"e1"
    assert (out / "tensorboard" / "top").read_bytes() == b"t"


def test_save_artifact_refuses_a_missing_local_file(out, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a local file or folder"):
        rt.save_artifact("x.txt", str(tmp_path / "nope.txt"))


@pytest.mark.parametrize("path", ["../escape.pt", "/abs.pt", "a/../../b", "a%2f..%2fb", "a\\b"])
def test_save_artifact_refuses_paths_leaving_the_job(out, path):
    with pytest.raises(InvalidPath, match="is refused"):
        rt.save_artifact(path, b"x")
