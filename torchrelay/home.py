"""Where a cluster keeps its files: ``RELAY_HOME`` (default ``~/.torchrelay``).

Contract: two clusters with different ``RELAY_HOME`` share nothing. Layout:

    <home>/state.db        SQLite state store (server)
    <home>/store/          artifact store (server, default)
    <home>/server.json     {"address": "http://127.0.0.1:PORT", "pid": …} of the running server
    <home>/admin.token     the first admin's token, written at the store's first start (mode 0600)
    <home>/cluster.json    pids and process groups of an embedded cluster started by `relay up`
    <home>/agents/<name>/  an agent's work dir (bundle cache, launches, logs)
    <home>/logs/           server and agent logs of an embedded cluster
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def relay_home() -> Path:
    home = Path(os.environ.get("RELAY_HOME") or Path.home() / ".torchrelay").expanduser().resolve()
    home.mkdir(parents=True, exist_ok=True)
    return home


def server_file(home: Path | None = None) -> Path:
    return (home or relay_home()) / "server.json"


def admin_token_file(home: Path | None = None) -> Path:
    return (home or relay_home()) / "admin.token"


def cluster_file(home: Path | None = None) -> Path:
    return (home or relay_home()) / "cluster.json"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: dict) -> None:
    """Atomic write (temp file + rename)."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
