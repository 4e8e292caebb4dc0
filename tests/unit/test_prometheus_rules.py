"""The pure parts of ``server.prometheus``: waiting-reason labels and step rates."""
import pytest

from torchrelay.server.prometheus import _step_rate, reason_class


@pytest.mark.parametrize("reason, label", [
    (None, "pending"), ("", "pending"),
    ("resources: no room now for a worker of 2 cpu", "resources"),
    ("Quota: user alice at 8 of 8 cpus", "quota"),
    ("no colon here", "no colon here"),
    ("x" * 60 + ": long", "other"),
    (": empty head", "other"),
])
def test_reason_class(reason, label):
    assert reason_class(reason) == label


@pytest.mark.parametrize("points, rate", [
    ([], None), ([(1, 10.0)], None),
    ([(0, 10.0), (10, 12.0)], 5.0),
    ([(0, 10.0), (5, 11.0), (20, 14.0)], 5.0),
    ([(0, 10.0), (10, 10.0)], None),          # no time passed
    ([(10, 10.0), (5, 11.0)], -5.0),          # a resumed attempt went back
])
def test_step_rate(points, rate):
    assert _step_rate(points) == rate
