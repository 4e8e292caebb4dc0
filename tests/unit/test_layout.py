"""The rank layout both the server and the training library read (torchrelay.layout)."""
import pytest

from torchrelay.layout import RankLayout
from torchrelay.spec import JobSpec, ParameterServerStrategy


@pytest.mark.parametrize("workers, servers, rank, is_server, shard", [
    (1, 0, 0, False, None),
    (4, 0, 3, False, None),
    (2, 1, 1, False, None),
    (2, 1, 2, True, 0),
    (3, 2, 4, True, 1),
])
def test_roles_by_rank(workers, servers, rank, is_server, shard):
    layout = RankLayout(workers=workers, servers=servers)
    assert layout.is_server(rank) is is_server
    if shard is None:
        with pytest.raises(ValueError, match="is a worker"):
            layout.shard_of(rank)
    else:
        assert layout.shard_of(rank) == shard


@pytest.mark.parametrize("rank", [-1, 5])
def test_a_rank_outside_the_world_is_refused(rank):
    with pytest.raises(ValueError, match=f"rank {rank} is outside"):
        RankLayout(workers=3, servers=2).is_server(rank)


def test_the_server_and_a_worker_see_the_same_layout():
    spec = JobSpec.model_validate({"name": "ps", "entrypoint": "python t.py", "workers": 3,
                                   "strategy": {"kind": "parameter_server", "servers": 2}})
    launched = RankLayout.of_spec(spec)
    seen = RankLayout.of_world(launched.world_size, spec.strategy)
    assert launched == seen == RankLayout(workers=3, servers=2)
    assert list(seen.server_ranks) == [3, 4]


def test_a_world_with_no_room_for_workers_is_refused():
    with pytest.raises(ValueError, match="world_size=2 leaves no workers next to servers=2"):
        RankLayout.of_world(2, ParameterServerStrategy(kind="parameter_server", servers=2))


def test_other_strategies_have_no_servers():
    assert RankLayout.of_world(4, None) == RankLayout(workers=4)
