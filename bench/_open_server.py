"""`relay server` without its guard: the baseline of bench/auth.py ("tokens off"), never a product.

torchrelay has no switch that turns authentication off, on purpose; the bench still needs the same
server with the check gone to measure what the check costs. This runs the `relay` CLI with
``guard.authorize`` replaced, before the app is built, by one that takes every request as the
admin's and checks nothing. Usage: ``python bench/_open_server.py server --port 0 ...``.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastapi import Request  # noqa: E402

from torchrelay.server import auth, guard  # noqa: E402

OPEN = auth.Principal(kind=auth.USER, name="bench", admin=True, role="admin")


async def _unchecked(request: Request) -> None:
    request.state.principal = OPEN


guard.authorize = _unchecked

if __name__ == "__main__":
    from torchrelay.client.cli.main import main

    sys.argv[0] = "relay"
    main()
