"""torchrelay.train.artifacts: where artifacts go, and what save_artifact accepts."""
from __future__ import annotations

import io
import os

import pytest
import torch

import torchrelay.train as rt
from torchrelay.errors import InvalidPath, InvalidSpec
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


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage under two names


@pytest.mark.parametrize("how", ["module-by-suffix", "state-dict-by-format"])
def test_save_artifact_as_safetensors_loads_without_pickle(out, how):
    from safetensors.torch import load_file

    model = _Tied()
    if how == "module-by-suffix":
        rt.save_artifact("model.safetensors", model)
        path = out / "model.safetensors"
    else:
        rt.save_artifact("weights.bin", model.state_dict(), format="safetensors")
        path = out / "weights.bin"
    assert path.read_bytes()[8:9] == b"{"  # a JSON header after its length, not a zip or a pickle
    loaded = load_file(str(path))
    assert loaded.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor)
    fresh = _Tied()
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.head.weight, model.head.weight)


def test_save_artifact_safetensors_refuses_what_it_cannot_hold(out):
    with pytest.raises(InvalidSpec, match=r"'step' is of type int, not a tensor; safetensors holds tensors only"):
        rt.save_artifact("m.safetensors", {"w": torch.ones(2), "step": 3})
    with pytest.raises(InvalidSpec, match="takes a state dict or a module, got list"):
        rt.save_artifact("m.bin", [torch.ones(2)], format="safetensors")
    with pytest.raises(InvalidSpec, match="format 'pickle' is not one of 'torch', 'safetensors'"):
        rt.save_artifact("m.bin", {"w": torch.ones(2)}, format="pickle")
    assert not out.exists() or list(out.iterdir()) == []


def test_bytes_named_safetensors_are_kept_as_they_are(out):
    rt.save_artifact("given.safetensors", b"already serialized")
    assert (out / "given.safetensors").read_bytes() == b"already serialized"


def test_a_folder_with_a_name_the_store_refuses_writes_nothing(out, tmp_path):
    folder = tmp_path / "run"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a")
    (folder / "sub" / "b#c.txt").write_text("b")
    with pytest.raises(InvalidPath, match=r"'run/sub/b#c.txt' is refused: it holds '#'"):
        rt.save_artifact("run", folder)
    assert not (out / "run").exists()
