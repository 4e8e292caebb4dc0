"""Durations as people write them: ``parse_duration("30d")`` -> seconds (pure, no I/O).

A number with one unit: ``s``, ``m``, ``h``, ``d`` or ``w`` (``90s``, ``15m``, ``12h``, ``30d``,
``2w``); a bare number is seconds. Raises ``InvalidSpec`` naming the value and the accepted form
when it is none of these or not above zero.
"""
from __future__ import annotations

import re

from torchrelay.errors import InvalidSpec

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_FORM = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_duration(value: str) -> float:
    match = _FORM.match(str(value).lower())
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"] if match else 0.0
    if not match or seconds <= 0:
        raise InvalidSpec(f"duration {value!r} is not one: write a positive number with a unit "
                          "s, m, h, d or w (e.g. 30d, 12h, 90s)")
    return seconds
