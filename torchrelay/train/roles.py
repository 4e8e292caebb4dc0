"""Who takes part in what: the one place where the strategy changes a rank's world.

Under the ``parameter_server`` strategy a job's world holds worker ranks and then server ranks
(``torchrelay.layout``). Server ranks hold no data, never join a collective on the default process
group (stop agreement, checkpoint saves), and never write checkpoints: worker rank 0 writes alone.
Under every other strategy each rank is a worker of the whole world; under ``fsdp`` with
``tensor_parallel: t`` the ``t`` consecutive ranks of a tensor-parallel group share one share of
the data (they compute one model split between them), so the data is split over ``world / t``.

Pure: built from (rank, world size, strategy); no process group, no I/O. The library's modules ask
this instead of testing the strategy's kind themselves.
"""
from __future__ import annotations

from dataclasses import dataclass

from torchrelay.layout import RankLayout
from torchrelay.spec import ParameterServerStrategy, Strategy

__all__ = ["Roles"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Roles:
    """What rank ``rank`` does in a job laid out as ``layout``."""

    rank: int
    layout: RankLayout
    parameter_server: bool = False
    tensor_parallel: int = 1

    @classmethod
    def of(cls, rank: int, world_size: int, strategy: Strategy | None) -> Roles:
        """The roles of ``rank``. Raises ``ValueError`` when a parameter-server world leaves no worker."""
        return cls(rank=rank, layout=RankLayout.of_world(world_size, strategy),
                   parameter_server=isinstance(strategy, ParameterServerStrategy),
                   tensor_parallel=getattr(strategy, "tensor_parallel", 1))

    @property
    def is_server(self) -> bool:
        """True on a parameter-server rank."""
        return self.rank >= self.layout.workers

    def data_world(self) -> tuple[int, int]:
        """``(share, shares)`` to split the data over: the workers only, one share per tensor-parallel
        group. Raises ``ValueError`` on a server rank."""
        if self.is_server:
            raise ValueError(f"rank {self.rank} is a parameter server (ranks {self.layout.workers}.."
                             f"{self.layout.world_size - 1}); it has no share of the data")
        return self.rank // self.tensor_parallel, self.layout.workers // self.tensor_parallel

    @property
    def collectives_on_default_group(self) -> bool:
        """Whether every rank of the default process group joins the library's collectives.

        False under the parameter server: its server ranks serve and never come back to a
        collective, so each worker answers for itself and worker 0 writes checkpoints alone."""
        return not self.parameter_server
