"""The server's config file (``relay server --config FILE.yaml``): settings too rich for a flag.

Today it holds the artifact store: its URL and the store options (endpoint, region,
credentials; see torchrelay.storage.options and docs/storage.md)::

    store:
      url: s3://relay/prod
      options:
        endpoint_url: http://rgw.example:7480
        region: us-east-1
        access_key_id: RELAY
        secret_access_key: "…"

``limits`` bounds what one request may upload (sizes in bytes or "1GiB", "512MB"; every key
optional, ``UploadLimits`` below has the defaults)::

    limits:
      bundle: 1GiB          # a job's code bundle
      artifact: 10GiB       # one artifact PUT
      log_batch: 32MiB      # one batch of log lines an agent posts
      metric_batch: 32MiB   # one batch of metric points

``store`` may also be the URL alone (``store: s3://relay/prod``). A ``--store`` flag given with
the file replaces its URL and keeps its options. The file is read by the server only: the
options that are not credentials (``public_options``) go to workers; secrets never leave it.

``parse_server_config(data, source)`` is pure and raises ``InvalidSpec`` naming the file and the
key on an unknown key or a malformed value; ``load_server_config(path)`` reads the file first.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from torchrelay.errors import InvalidSpec

_TOP_KEYS = ("store", "limits")
GiB, MiB = 2**30, 2**20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UploadLimits:
    """The most bytes one request may upload, by kind (``torchrelay.server.uploads`` enforces them)."""

    bundle: int = 1 * GiB
    artifact: int = 10 * GiB
    log_batch: int = 32 * MiB
    metric_batch: int = 32 * MiB
    # any other body (a job spec, a registration, a heartbeat): FastAPI reads a route's whole body
    # before its dependencies run, so this bounds what a caller without a token can make it hold
    request: int = 8 * MiB


LIMIT_NAMES = tuple(f.name for f in dataclasses.fields(UploadLimits))
_STORE_KEYS = ("url", "options")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    store_url: str | None = None
    store_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    limits: UploadLimits = dataclasses.field(default_factory=UploadLimits)


def parse_server_config(data: Any, source: str = "server config") -> ServerConfig:
    """A ``ServerConfig`` from the file's parsed YAML (None: an empty file). Raises ``InvalidSpec``."""
    if data is None:
        return ServerConfig()
    if not isinstance(data, dict):
        raise InvalidSpec(f"{source}: expected a mapping with the keys {', '.join(_TOP_KEYS)}, "
                          f"got {type(data).__name__}")
    _refuse_unknown(data, _TOP_KEYS, source)
    limits = _parse_limits(data.get("limits"), source)
    store = data.get("store")
    if store is None:
        return ServerConfig(limits=limits)
    if isinstance(store, str):
        store = {"url": store}
    if not isinstance(store, dict):
        raise InvalidSpec(f"{source}: store must be a URL or a mapping with url and options, "
                          f"got {type(store).__name__}")
    _refuse_unknown(store, _STORE_KEYS, f"{source}: store")
    url = store.get("url")
    if url is not None and (not isinstance(url, str) or not url.strip()):
        raise InvalidSpec(f"{source}: store.url must be a non-empty URL string, got {url!r}")
    options = store.get("options") or {}
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise InvalidSpec(f"{source}: store.options must be a mapping of option names to values "
                          "(docs/storage.md lists them)")
    return ServerConfig(store_url=url.strip() if url else None, store_options=dict(options), limits=limits)


def _parse_limits(data: Any, source: str) -> UploadLimits:
    from torchrelay.spec import parse_memory

    if data is None:
        return UploadLimits()
    if not isinstance(data, dict):
        raise InvalidSpec(f"{source}: limits must be a mapping with the keys {', '.join(LIMIT_NAMES)}, "
                          f"got {type(data).__name__}")
    _refuse_unknown(data, LIMIT_NAMES, f"{source}: limits")
    sizes = {}
    for name, value in data.items():
        try:
            sizes[name] = parse_memory(value)
        except InvalidSpec:
            sizes[name] = -1
        if isinstance(value, bool) or sizes[name] <= 0:
            raise InvalidSpec(f"{source}: limits.{name} must be a size above 0 (bytes, or e.g. '1GiB', "
                              f"'512MB'), got {value!r}")
    return UploadLimits(**sizes)


def load_server_config(path: str | Path) -> ServerConfig:
    """Read and parse the YAML file at ``path``. Raises ``InvalidSpec`` naming the file."""
    return parse_server_config(read_yaml(path, "server config"), f"server config {str(path)!r}")


def read_yaml(path: str | Path, what: str) -> Any:
    """The parsed YAML of the file at ``path``; ``InvalidSpec`` naming ``what`` and the file when it
    cannot be read or parsed (the server's config and quota files)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidSpec(f"{what} {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidSpec(f"{what} {str(path)!r} is not valid YAML: {exc}") from None


def _refuse_unknown(data: dict, known: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in known:
            raise InvalidSpec(f"{where}: unknown key {key!r}; known keys: {', '.join(known)}")
