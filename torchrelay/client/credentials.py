"""The client's tokens: which one a call to a server sends, and where ``relay login`` keeps them.

Contract:
- ``token_for(address)``: the first of ``RELAY_TOKEN``; the embedded cluster's admin token
  (``<RELAY_HOME>/admin.token``) when ``<RELAY_HOME>/server.json`` names this very address; the
  token ``relay login`` stored for the address. None when there is none.
- The credentials file is ``credentials.json`` in ``$RELAY_CONFIG_DIR``, else
  ``$XDG_CONFIG_HOME/torchrelay``, else ``~/.config/torchrelay``: ``{address: token}``, written
  atomically with mode 0600 (the folder 0700). ``store_token``/``forget_token`` change one entry.
- Reads never raise: an unreadable file counts as empty.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from torchrelay.home import admin_token_file, read_json, relay_home, server_file


def config_dir() -> Path:
    if os.environ.get("RELAY_CONFIG_DIR"):
        return Path(os.environ["RELAY_CONFIG_DIR"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "torchrelay"


def credentials_file() -> Path:
    return config_dir() / "credentials.json"


def _key(address: str) -> str:
    return address.strip().rstrip("/")


def stored_tokens() -> dict[str, str]:
    data = read_json(credentials_file())
    return {k: v for k, v in (data or {}).items() if isinstance(v, str)}


def store_token(address: str, token: str) -> Path:
    """Keep ``token`` for ``address`` (replacing one stored before). Returns the file."""
    tokens = stored_tokens()
    tokens[_key(address)] = token.strip()
    return _write(tokens)


def forget_token(address: str) -> bool:
    tokens = stored_tokens()
    gone = tokens.pop(_key(address), None) is not None
    if gone:
        _write(tokens)
    return gone


def _write(tokens: dict[str, str]) -> Path:
    path = credentials_file()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(tokens, out, indent=2, sort_keys=True)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def local_admin_token(address: str) -> str | None:
    """The embedded cluster's admin token when ``RELAY_HOME``'s server is at ``address``."""
    home = relay_home()
    info = read_json(server_file(home))
    if not info or _key(str(info.get("address", ""))) not in {_key(a) for a in address.split(",")}:
        return None
    try:
        return admin_token_file(home).read_text().strip() or None
    except OSError:
        return None


def token_for(address: str) -> str | None:
    """See the module docstring."""
    if os.environ.get("RELAY_TOKEN"):
        return os.environ["RELAY_TOKEN"].strip()
    local = local_admin_token(address)
    if local:
        return local
    stored = stored_tokens()
    for one in [address, *address.split(",")]:
        if _key(one) in stored:
            return stored[_key(one)]
    return None
