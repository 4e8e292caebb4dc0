"""The long-polls' notifier (server/notify.py): bumps wake waiters, close ends every wait."""
import asyncio

import pytest

from torchrelay.server.notify import Notifier

BOUND_S = 10  # a wait that should end at once; the bound only keeps a broken notifier from hanging the suite


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def test_a_bump_wakes_the_waiter_of_its_key_only():
    async def scenario():
        n = Notifier()
        seen = n.version("a")
        waiting_a = asyncio.ensure_future(n.wait("a", seen, 60))
        waiting_b = asyncio.ensure_future(n.wait("b", n.version("b"), 60))
        await asyncio.sleep(0)
        n.bump("a")
        got = await waiting_a
        assert got == seen + 1 == n.version("a")
        assert not waiting_b.done()
        waiting_b.cancel()

    run(scenario())


def test_a_wait_on_a_version_already_passed_returns_at_once():
    n = Notifier()
    seen = n.version("k")
    n.bump("k")
    assert run(n.wait("k", seen, 60)) == seen + 1


@pytest.mark.parametrize("waiters", [1, 3])
def test_close_ends_every_wait_in_flight_and_every_later_one(waiters):
    async def scenario():
        n = Notifier()
        keys = [f"node:{i}" for i in range(waiters)]
        seen = {key: n.version(key) for key in keys}
        waiting = [asyncio.ensure_future(n.wait(key, seen[key], 60)) for key in keys]
        await asyncio.sleep(0)
        assert not any(w.done() for w in waiting)
        n.close()
        assert await asyncio.gather(*waiting) == [seen[key] for key in keys]  # unchanged: nothing happened
        assert n.closed
        assert await n.wait("later", n.version("later"), 60) == n.version("later")
        n.close()  # idempotent
        n.bump(keys[0])  # bumps still count after close
        assert n.version(keys[0]) == seen[keys[0]] + 1

    run(scenario())
