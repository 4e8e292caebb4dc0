"""Per-user quotas the server hands the scheduling policy (``relay server --quotas FILE.yaml``).

The file maps user names to limits; the key ``default`` applies to every user not named
(including jobs without a user, whose user is ""). Any limit may be left out (no limit)::

    default: {cpus: 8, gpus: 1, jobs: 4}
    alice:   {cpus: 32, gpus: 4, jobs: 20}
    bob:     {jobs: 2}

``QuotaTable.parse(data)`` / ``QuotaTable.load(path)`` raise ``InvalidSpec`` naming the user,
the key and the value on any malformed entry. ``for_users(users)`` gives the policy's
``SchedulerInput.quotas`` for the users of one cycle. Pure data apart from ``load``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from torchrelay.errors import InvalidSpec
from torchrelay.scheduler import Quota
from torchrelay.server.config import read_yaml

_LIMITS = {"cpus": float, "gpus": int, "jobs": int}


@dataclass(frozen=True)
class QuotaTable:
    users: dict[str, Quota] = field(default_factory=dict)
    default: Quota | None = None

    @classmethod
    def parse(cls, data: Any, source: str = "quotas") -> "QuotaTable":
        """Validate a mapping ``{user | "default": {cpus, gpus, jobs}}``. Raises InvalidSpec."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise InvalidSpec(f"{source}: expected a mapping of user -> {{cpus, gpus, jobs}}, "
                              f"got {type(data).__name__}: {data!r:.80}")
        users: dict[str, Quota] = {}
        default = None
        for user, limits in data.items():
            quota = _parse_quota(str(user), limits, source)
            if user == "default":
                default = quota
            else:
                users[str(user)] = quota
        return cls(users=users, default=default)

    @classmethod
    def load(cls, path: str | Path) -> "QuotaTable":
        """Read a YAML quota file. Raises InvalidSpec naming the file when it is unreadable or malformed."""
        return cls.parse(read_yaml(path, "quota file"), source=f"quota file {str(path)!r}")

    def quota_of(self, user: str) -> Quota | None:
        return self.users.get(user, self.default)

    def for_users(self, users: Iterable[str]) -> tuple[tuple[str, Quota], ...]:
        """(user, quota) for each of ``users`` that has one, sorted by user (deterministic)."""
        out = []
        for user in sorted(set(users)):
            quota = self.quota_of(user)
            if quota is not None:
                out.append((user, quota))
        return tuple(out)

    def to_public(self) -> dict[str, dict[str, float | int | None]]:
        shown = {u: _public(q) for u, q in sorted(self.users.items())}
        if self.default is not None:
            shown["default"] = _public(self.default)
        return shown


def _public(quota: Quota) -> dict[str, float | int | None]:
    return {"cpus": quota.cpus, "gpus": quota.gpus, "jobs": quota.jobs}


def _parse_quota(user: str, limits: Any, source: str) -> Quota:
    if not isinstance(limits, dict):
        raise InvalidSpec(f"{source}: {user}: expected {{cpus, gpus, jobs}}, got {limits!r:.80}")
    values: dict[str, float | int] = {}
    for key, value in limits.items():
        kind = _LIMITS.get(key)
        if kind is None:
            raise InvalidSpec(f"{source}: {user}: unknown key {key!r}; use cpus, gpus or jobs")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
        if ok and kind is int and float(value) != int(value):
            ok = False
        if not ok:
            what = "a number" if kind is float else "a whole number"
            raise InvalidSpec(f"{source}: {user}.{key}: {value!r} is not {what} >= 0")
        values[key] = kind(value)
    return Quota(**values)
