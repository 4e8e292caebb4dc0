"""Which rank plays which role in a job: the one place the rank layout is written down.

Pure data, no I/O. The server orders a job's launches by it (workers first, then each role's
processes) and the training library reads it back inside a worker, so both sides agree on
what rank ``r`` is without either re-deriving the rule:

- ranks ``0 … W-1`` are the job's workers (``W = spec.workers``);
- a parameter-server job's servers follow as ranks ``W … W+S-1``, server ``r`` holding shard
  ``r - W``.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchrelay.spec import JobSpec, ParameterServerStrategy, Strategy

__all__ = ["RankLayout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLayout:
    """The ranks of one job: ``workers`` worker ranks, then ``servers`` parameter-server ranks."""

    workers: int
    servers: int = 0

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"a job needs at least one worker rank, got workers={self.workers}")
        if self.servers < 0:
            raise ValueError(f"servers={self.servers} must be 0 or more")

    @classmethod
    def of_spec(cls, spec: JobSpec) -> RankLayout:
        """The layout the server launches ``spec`` with."""
        servers = spec.strategy.servers if isinstance(spec.strategy, ParameterServerStrategy) else 0
        return cls(workers=spec.workers, servers=servers)

    @classmethod
    def of_world(cls, world_size: int, strategy: Strategy | None) -> RankLayout:
        """The layout seen from inside a worker that knows only the world size and the strategy.

        Raises ``ValueError`` when a parameter-server world leaves no worker beside its servers.
        """
        servers = strategy.servers if isinstance(strategy, ParameterServerStrategy) else 0
        if world_size - servers < 1:
            raise ValueError(f"world_size={world_size} leaves no workers next to servers={servers}; "
                             f"the platform must launch workers + servers ranks")
        return cls(workers=world_size - servers, servers=servers)

    @property
    def world_size(self) -> int:
        return self.workers + self.servers

    def is_server(self, rank: int) -> bool:
        """True for a parameter-server rank. Raises ``ValueError`` for a rank outside the world."""
        self._check(rank)
        return rank >= self.workers

    def shard_of(self, rank: int) -> int:
        """The parameter-server shard ``rank`` serves. Raises ``ValueError`` on a worker rank."""
        if not self.is_server(rank):
            raise ValueError(f"rank {rank} is a worker (ranks 0..{self.workers - 1}); it serves no shard")
        return rank - self.workers

    @property
    def worker_ranks(self) -> range:
        return range(self.workers)

    @property
    def server_ranks(self) -> range:
        return range(self.workers, self.world_size)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the job's world of {self.world_size} ranks")
