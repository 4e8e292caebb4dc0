"""What `relay login` does, for tests whose servers a helper started: the admin token a server
wrote at its store's first start, stored for its address (in the session's RELAY_CONFIG_DIR), and
the header a test's own HTTP call sends."""
from __future__ import annotations

import time
from pathlib import Path


def login_as_admin(home: Path, address: str) -> None:
    """Store the admin token the server wrote in ``home`` for ``address`` (waits for the file)."""
    from torchrelay.client.credentials import store_token
    from torchrelay.home import admin_token_file

    deadline = time.monotonic() + 30
    while not admin_token_file(home).exists():
        assert time.monotonic() < deadline, f"the server wrote no {admin_token_file(home)}"
        time.sleep(0.05)
    store_token(address, admin_token_file(home).read_text().strip())


def bearer(address: str) -> dict[str, str]:
    """The ``Authorization`` header a test's own HTTP call to ``address`` sends: the token the
    client would use there (the admin's, for a server a fixture started)."""
    from torchrelay.client.credentials import token_for

    token = token_for(address)
    return {"authorization": f"Bearer {token}"} if token else {}
