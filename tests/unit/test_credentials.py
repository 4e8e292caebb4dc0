"""Which token the client sends (torchrelay/client/credentials.py): RELAY_TOKEN, then the embedded
cluster's own for the address RELAY_HOME records, then what `relay login` stored; the file's mode."""
import json

import pytest

from torchrelay.client import credentials
from torchrelay.home import admin_token_file, server_file

LOCAL, OTHER = "http://127.0.0.1:8470", "http://10.0.0.9:8470"


@pytest.fixture
def places(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RELAY_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.delenv("RELAY_TOKEN", raising=False)
    (tmp_path / "home").mkdir()
    server_file(tmp_path / "home").write_text(json.dumps({"address": LOCAL, "pid": 1}))
    admin_token_file(tmp_path / "home").write_text("rlu_local\n")
    credentials.store_token(OTHER + "/", "rlu_stored_other")
    credentials.store_token(LOCAL, "rlu_stored_local")
    return monkeypatch


@pytest.mark.parametrize("env_token, address, expected", [
    (None, LOCAL, "rlu_local"),                       # the embedded cluster's own wins over a stored one
    (None, OTHER, "rlu_stored_other"),                # stored with a trailing slash, found without
    (None, "http://10.0.0.9:8470,http://x:1", "rlu_stored_other"),   # any server of a list
    (None, "http://nowhere:1", None),
    ("rlu_env", LOCAL, "rlu_env"),                    # RELAY_TOKEN wins over everything
    ("rlu_env", "http://nowhere:1", "rlu_env"),
])
def test_the_token_a_call_sends(places, env_token, address, expected):
    if env_token:
        places.setenv("RELAY_TOKEN", env_token)
    assert credentials.token_for(address) == expected


def test_the_credentials_file_is_private_and_forgets(places, tmp_path):
    path = credentials.credentials_file()
    assert path == tmp_path / "config" / "credentials.json"
    assert path.stat().st_mode & 0o777 == 0o600
    assert credentials.forget_token(OTHER) is True and credentials.forget_token(OTHER) is False
    assert credentials.token_for(OTHER) is None and credentials.stored_tokens() == {LOCAL: "rlu_stored_local"}


def test_the_config_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("RELAY_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert credentials.config_dir() == tmp_path / "xdg" / "torchrelay"
