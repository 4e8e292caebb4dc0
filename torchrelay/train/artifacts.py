"""Where a worker's files go: the job's folder in the artifact store.

Contract:
- ``job_store()`` is the store and job id this process writes to. As a torchrelay job:
  ``RELAY_STORE_URL`` (any fsspec URL), ``RELAY_STORE_OPTIONS`` (JSON: where the store is,
  e.g. an S3 endpoint and region, as the server was configured; no credentials: those are this
  node's own, from the environment or ``~/.aws``) and ``RELAY_JOB_ID``. Otherwise (plain ``python`` or
  ``torchrun``): a local folder, ``$RELAY_OUTPUT_DIR`` or ``./relay-outputs``, with job id
  ``local``. Every path is built by ``torchrelay.storage.ArtifactStore``.
- ``save_artifact(path, obj)`` writes ``obj`` at ``jobs/<job>/artifacts/<path>`` atomically and
  returns its URL: ``bytes`` as they are, a local file (``str``/``os.PathLike`` that exists)
  copied, a local directory copied file by file below ``path``, anything else (tensors, state
  dicts) through ``torch.save``, or as safetensors with ``format="safetensors"`` (the default
  for a path ending in ``.safetensors``: nothing runs when it is loaded). It writes from
  whichever rank calls it: call it on ``ctx.is_main`` for a shared model. Raises
  ``InvalidPath`` for a path that is not plain (``torchrelay.paths``), ``StorageError`` naming
  the path and the cause.
- ``artifact_url(path)`` is the URL ``save_artifact(path, …)`` writes to (no I/O).
"""
from __future__ import annotations

import io
import json
import os
import threading
from typing import Any

import torch

from torchrelay.errors import InvalidSpec, StorageError
from torchrelay.storage import ArtifactStore

LOCAL_JOB_ID = "local"
DEFAULT_OUTPUT_DIR = "relay-outputs"

_stores: dict[str, ArtifactStore] = {}
_stores_lock = threading.Lock()


def store_location(env: dict[str, str] | os._Environ) -> tuple[str, str]:
    """(store URL, job id) for ``env``. Pure. Raises ``InvalidSpec`` when the job variables disagree."""
    job_id = env.get("RELAY_JOB_ID") or LOCAL_JOB_ID
    url = env.get("RELAY_STORE_URL")
    if not url:
        url = os.path.abspath(env.get("RELAY_OUTPUT_DIR") or DEFAULT_OUTPUT_DIR)
    prefix = env.get("RELAY_JOB_STORE_PREFIX")
    if prefix and prefix.strip("/") != ArtifactStore.job_prefix(job_id):
        raise InvalidSpec(f"RELAY_JOB_STORE_PREFIX={prefix!r} does not match RELAY_JOB_ID={job_id!r}; "
                          f"expected {ArtifactStore.job_prefix(job_id)!r}")
    return url, job_id


def store_options(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """The store options ``RELAY_STORE_OPTIONS`` holds (none when unset). Pure. Raises ``InvalidSpec``."""
    text = env.get("RELAY_STORE_OPTIONS")
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise InvalidSpec(f"RELAY_STORE_OPTIONS={text!r:.200} is not a JSON object of store options")
    return options


def job_store() -> tuple[ArtifactStore, str]:
    """The (store, job id) of this process; the store is made once per URL and options."""
    url, job_id = store_location(os.environ)
    options = store_options(os.environ)
    key = url + "\0" + json.dumps(options, sort_keys=True)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ArtifactStore(url, options)
    return store, job_id


def artifact_url(path: str) -> str:
    """URL of the artifact ``path`` of this job. Raises ``StorageError`` for a path leaving the job's folder."""
    store, job_id = job_store()
    return store.url_of(ArtifactStore.artifact_key(job_id, path))


def serialize(obj: Any) -> bytes:
    """Bytes of ``obj`` as ``torch.save`` writes them."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_artifact(path: str, obj: Any, *, format: str | None = None) -> str:  # noqa: A002
    """Write ``obj`` as the job's artifact ``path`` (atomic per file); returns its URL.

    ``format="safetensors"`` (the default for a ``path`` ending in ``.safetensors``) writes a
    state dict (or an ``nn.Module``'s) of tensors as safetensors: loading it runs no code, unlike
    a pickle. ``format="torch"`` (the default for other objects) uses ``torch.save``.
    Raises ``InvalidPath`` (a path that is not plain or leaves the job's folder), ``StorageError``
    (unwritable store), ``InvalidSpec`` (an unknown format, or a value safetensors cannot hold)
    or ``FileNotFoundError`` for a ``str``/``PathLike`` naming no local file.
    """
    store, job_id = job_store()
    key = ArtifactStore.artifact_key(job_id, path)
    if format is None and path.endswith(".safetensors") and not isinstance(obj, (bytes, bytearray, memoryview,
                                                                                 str, os.PathLike)):
        format = "safetensors"
    if format not in (None, "torch", "safetensors"):
        raise InvalidSpec(f"save_artifact({path!r}): format {format!r} is not one of 'torch', 'safetensors'")
    if format == "safetensors":
        store.put_bytes(key, safetensors_bytes(obj, path))
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        store.put_bytes(key, bytes(obj))
    elif isinstance(obj, (str, os.PathLike)):
        local = os.fspath(obj)
        if os.path.isdir(local):
            # every name checked before the first write: a refused one leaves nothing half copied
            keyed = []
            for folder, _dirs, files in os.walk(local):
                for full in (os.path.join(folder, name) for name in sorted(files)):
                    rel = os.path.relpath(full, local).replace(os.sep, "/")
                    keyed.append((ArtifactStore.artifact_key(job_id, f"{path}/{rel}"), full))
            for file_key, full in keyed:
                store.put_bytes(file_key, _read_local(full))
        elif os.path.isfile(local):
            store.put_bytes(key, _read_local(local))
        else:
            raise FileNotFoundError(f"save_artifact({path!r}, {local!r}): {local!r} is not a local file or "
                                    "folder; pass bytes, a tensor or state dict, or the path of a file")
    else:
        store.put_bytes(key, serialize(obj))
    return store.url_of(key)


def safetensors_bytes(obj: Any, path: str = "model.safetensors") -> bytes:
    """``obj`` (a state dict of tensors, or an ``nn.Module``) in the safetensors format. Tensors
    that share memory (tied weights) are copied apart. Raises ``InvalidSpec`` naming a value that
    is not a tensor."""
    from safetensors.torch import save

    state = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
    if not isinstance(state, dict):
        raise InvalidSpec(f"save_artifact({path!r}, format='safetensors') takes a state dict or a module, "
                          f"got {type(obj).__name__}")
    tensors, seen = {}, set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidSpec(f"save_artifact({path!r}, format='safetensors'): {name!r} is of type "
                              f"{type(value).__name__}, not a tensor; safetensors holds tensors only "
                              "(save other values as JSON beside it)")
        tensor = value.detach().cpu().contiguous()
        storage = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        tensors[str(name)] = tensor.clone() if storage in seen else tensor
        seen.add(storage)
    return save(tensors)


def _read_local(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise StorageError(f"cannot read local file {path!r} to save it as an artifact: {exc}") from exc
