"""The bad-credential limiter (torchrelay/server/ratelimit.py): a table of failure times and
what it says at a moment."""
import pytest

from torchrelay.server.ratelimit import FailureLimiter


@pytest.mark.parametrize("failures, now, blocked, retry_after", [
    ([], 0.0, False, 0.0),
    ([0.0, 1.0], 2.0, False, 0.0),                 # under the limit (3)
    ([0.0, 1.0, 2.0], 2.0, True, 58.0),            # the third within the window blocks
    ([0.0, 1.0, 2.0], 59.9, True, 0.1),
    ([0.0, 1.0, 2.0], 60.0, False, 0.0),           # the first left the window
    ([0.0, 30.0, 61.0], 62.0, False, 0.0),         # never three within one minute
    ([0.0, 1.0, 2.0, 3.0, 4.0], 61.5, True, 0.5),  # the newest three count
])
def test_a_window_of_failures_blocks_and_frees(failures, now, blocked, retry_after):
    limiter = FailureLimiter(limit=3, window_s=60.0)
    for t in failures:
        limiter.failed("10.0.0.1", t)
    assert limiter.blocked("10.0.0.1", now) is blocked
    assert limiter.retry_after("10.0.0.1", now) == pytest.approx(retry_after)
    assert limiter.blocked("10.0.0.2", now) is False  # per address


def test_it_forgets_the_least_recent_address_past_its_bound():
    limiter = FailureLimiter(limit=1, window_s=60.0, max_addresses=2)
    for i, addr in enumerate(["a", "b", "c"]):
        limiter.failed(addr, float(i))
    assert [limiter.blocked(a, 3.0) for a in "abc"] == [False, True, True]


@pytest.mark.parametrize("limit, window", [(0, 60.0), (3, 0.0)])
def test_nonsense_settings_are_refused_naming_them(limit, window):
    with pytest.raises(ValueError, match=str(limit)):
        FailureLimiter(limit=limit, window_s=window)
