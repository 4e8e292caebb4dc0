"""Pure parts of the parameter server: the byte-balanced sharding plan and the wire header."""
from __future__ import annotations

import types

import pytest

from torchrelay.spec import ParameterServerStrategy
from torchrelay.train.ps import protocol as P
from torchrelay.train.ps import worker_world
from torchrelay.train.ps.plan import CUT_ALIGN, ITEMSIZE, PARAM_ALIGN, ParamSpec, Plan, make_plan

LAYOUTS = {
    "one big tensor": [ParamSpec("w", "float32", (1000, 1000))],
    "mlp": [ParamSpec("0.weight", "float32", (64, 64)), ParamSpec("0.bias", "float32", (64,)),
            ParamSpec("2.weight", "float32", (10, 64)), ParamSpec("2.bias", "float32", (10,))],
    "mixed dtypes": [ParamSpec("a", "float16", (7, 3)), ParamSpec("b", "float64", (5,)),
                     ParamSpec("c", "bfloat16", (33,)), ParamSpec("d", "int8", (3,)),
                     ParamSpec("e", "complex128", (4,))],
    "tiny": [ParamSpec("s", "float32", ())],
}


def covered(plan: Plan) -> dict[int, list[tuple[int, int]]]:
    """param -> sorted (start, end) element ranges over all shards."""
    out: dict[int, list[tuple[int, int]]] = {}
    for i in range(plan.servers):
        for seg in plan.shard(i).segments:
            out.setdefault(seg.param, []).append((seg.start, seg.start + seg.numel))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("servers", [1, 2, 3, 7])
def test_plan_covers_every_element_once_and_balances_bytes(layout, servers):
    plan = make_plan(layout, servers)
    assert plan.servers == servers
    sizes = [plan.shard(i).nbytes for i in range(servers)]
    assert sum(sizes) == plan.total_nbytes
    assert max(sizes) - min(sizes) <= CUT_ALIGN
    ranges = covered(plan)
    for index, spec in enumerate(layout):
        assert plan.offsets[index] % PARAM_ALIGN == 0
        # contiguous, non-overlapping, complete
        spans = ranges[index]
        assert spans[0][0] == 0 and spans[-1][1] == spec.numel
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for i in range(servers):
        for seg in plan.shard(i).segments:
            assert seg.offset % ITEMSIZE[seg.dtype] == 0  # a typed view is possible
            assert 0 <= seg.offset and seg.offset + seg.nbytes <= plan.shard(i).nbytes


def test_a_large_tensor_is_split_across_servers():
    plan = make_plan(LAYOUTS["one big tensor"], 4)
    assert [len(plan.shard(i).segments) for i in range(4)] == [1, 1, 1, 1]
    assert [plan.shard(i).segments[0].numel for i in range(4)] == [250_000] * 4


def test_plan_json_round_trip_and_id_tracks_layout():
    plan = make_plan(LAYOUTS["mixed dtypes"], 3)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.plan_id == plan.plan_id
    other = make_plan(LAYOUTS["mixed dtypes"][:-1] + [ParamSpec("e", "complex128", (5,))], 3)
    assert other.plan_id != plan.plan_id
    assert make_plan(LAYOUTS["mixed dtypes"], 2).plan_id != plan.plan_id


@pytest.mark.parametrize("layout,servers,message", [
    ([], 1, "no parameters"),
    ([ParamSpec("x", "float8", (2,))], 1, "'float8'"),
    ([ParamSpec("x", "float32", (2,))], 0, "servers=0"),
])
def test_plan_refuses_bad_input_naming_it(layout, servers, message):
    with pytest.raises(ValueError, match=message):
        make_plan(layout, servers)


HEADERS = [
    P.Header(P.Op.PUSH, worker=3, shard=1, step=2**40, plan_id=2**63 - 1, payload_len=10**9, aux=7),
    P.Header(P.Op.HELLO),
    P.Header(P.Op.PARAMS, aux=P.join_aux(5, 2)),
    P.Header(P.Op.PUSH, worker=1, step=3, flags=P.FLAG_SHM),
]


@pytest.mark.parametrize("header", HEADERS)
def test_header_round_trip(header):
    assert P.unpack(P.pack(header)) == header


def test_aux_packs_staleness_and_queue_depth():
    assert P.split_aux(P.join_aux(5, 2)) == (5, 2)
    assert P.split_aux(P.join_aux(2**40, 0)) == (2**32 - 1, 0)


@pytest.mark.parametrize("mutate,message", [
    (lambda b: b[:10], "10 bytes"),
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:4] + bytes([P.VERSION + 1]) + b[5:], f"version {P.VERSION + 1}"),
    (lambda b: b[:5] + bytes([200]) + b[6:], "unknown op 200"),
    (lambda b: b[:6] + b"\x02\x00" + b[8:], "bits unknown"),
    (lambda b: b[:5] + bytes([int(P.Op.HELLO), P.FLAG_SHM, 0]) + b[8:], "only PUSH, PULL, PARAMS"),
])
def test_unpack_refuses_malformed_headers(mutate, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.unpack(mutate(P.pack(HEADERS[0])))


ME = P.ShardIdentity(shard=1, plan_id=42, num_workers=2, shard_nbytes=100, state_nbytes=200)


@pytest.mark.parametrize("header,problem", [
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 100), None),
    (P.Header(P.Op.PULL, 1, 1, 0, 42, 0), None),
    (P.Header(P.Op.HELLO, 1, 1, 0, 42, 0, 2), None),
    (P.Header(P.Op.SET_STATE, 0, 1, 0, 42, 210, 10), None),
    (P.Header(P.Op.OK, 0, 1, 0, 42, 0), "not a request"),
    (P.Header(P.Op.PUSH, 0, 0, 0, 42, 100), "shard 0 reached shard 1"),
    (P.Header(P.Op.PUSH, 0, 1, 0, 41, 100), "plan_id"),
    (P.Header(P.Op.PUSH, 2, 1, 0, 42, 100), "worker 2 is out of range"),
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 99), "expects exactly 100"),
    (P.Header(P.Op.PULL, 0, 1, 0, 42, 5), "expects exactly 0"),
    (P.Header(P.Op.SET_STATE, 0, 1, 0, 42, 200, 0), "meta length 0"),
    (P.Header(P.Op.SET_STATE, 0, 1, 0, 42, 209, 10), "expects exactly 210"),
    (P.Header(P.Op.HELLO, 0, 1, 0, 42, 0, 3), "3 workers"),
])
def test_check_request_table(header, problem):
    got = P.check_request(header, ME)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


SHM = P.FLAG_SHM


@pytest.mark.parametrize("header,attached,problem", [
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 0, 0, SHM), True, None),
    (P.Header(P.Op.PULL, 0, 1, 0, 42, 0, 0, SHM), True, None),
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 100), True, None),            # TCP push on an attached connection
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 0, 0, SHM), False, "no shared memory attached"),
    (P.Header(P.Op.PUSH, 0, 1, 0, 42, 100, 0, SHM), True, "expects exactly 0"),  # payload on both paths
    (P.Header(P.Op.PUSH, 0, 1, 0, 41, 0, 0, SHM), True, "plan_id"),
    (P.Header(P.Op.ATTACH, 0, 1, 0, 42, P.ATTACH.size), False, None),
    (P.Header(P.Op.ATTACH, 0, 1, 0, 42, P.ATTACH.size + 1), False, f"expects exactly {P.ATTACH.size}"),
])
def test_check_request_with_shared_memory_table(header, attached, problem):
    got = P.check_request(header, ME, shm_attached=attached)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


@pytest.mark.parametrize("rank,world,servers,expected", [
    (0, 3, 1, (0, 2)), (1, 3, 1, (1, 2)), (0, 5, 2, (0, 3)), (2, 5, 2, (2, 3)),
])
def test_worker_world_counts_workers_only(rank, world, servers, expected):
    ctx = types.SimpleNamespace(rank=rank, world_size=world,
                                strategy=ParameterServerStrategy(kind="parameter_server", servers=servers))
    assert worker_world(ctx) == expected


def test_worker_world_refuses_server_ranks_and_passes_other_strategies_through():
    strategy = ParameterServerStrategy(kind="parameter_server", servers=1)
    with pytest.raises(ValueError, match="rank 2 is a parameter server"):
        worker_world(types.SimpleNamespace(rank=2, world_size=3, strategy=strategy))
    with pytest.raises(ValueError, match="leaves no workers"):
        worker_world(types.SimpleNamespace(rank=0, world_size=1, strategy=strategy))
    assert worker_world(types.SimpleNamespace(rank=1, world_size=4, strategy=None)) == (1, 4)


def test_strategy_comes_from_ctx_or_relay_strategy_env(monkeypatch):
    from torchrelay.train.ps import strategy_of

    monkeypatch.setenv("RELAY_STRATEGY", '{"kind": "parameter_server", "servers": 2, "mode": "ssp", "staleness": 3}')
    got = strategy_of(types.SimpleNamespace(rank=0, world_size=4))
    assert isinstance(got, ParameterServerStrategy) and (got.servers, got.staleness) == (2, 3)
    assert worker_world(types.SimpleNamespace(rank=1, world_size=4)) == (1, 2)
    monkeypatch.setenv("RELAY_STRATEGY", '{"kind": "ddp"}')
    assert worker_world(types.SimpleNamespace(rank=3, world_size=4)) == (3, 4)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("servers", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [16, 48, 1 << 20])
def test_chunk_pieces_tile_the_shard_on_element_edges(name, servers, chunk_bytes):
    from torchrelay.train.ps.server import chunk_pieces

    plan = make_plan(LAYOUTS[name], servers)
    for i in range(servers):
        shard = plan.shard(i)
        chunks = chunk_pieces(shard, chunk_bytes)
        if shard.nbytes == 0:
            assert chunks == []
            continue
        # the chunks tile [0, nbytes) in order, none longer than chunk_bytes
        assert [c[0] for c in chunks] == list(range(0, shard.nbytes, chunk_bytes))
        assert chunks[-1][1] == shard.nbytes and all(0 < e - b <= chunk_bytes for b, e, _ in chunks)
        # the pieces of all chunks tile every segment exactly, on its element edges
        seen: dict[int, list[tuple[int, int]]] = {}
        for begin, end, pieces in chunks:
            for seg_index, lo, hi in pieces:
                seg = shard.segments[seg_index]
                assert begin <= lo < hi <= end
                assert (lo - seg.offset) % ITEMSIZE[seg.dtype] == 0 and (hi - seg.offset) % ITEMSIZE[seg.dtype] == 0
                seen.setdefault(seg_index, []).append((lo, hi))
        for seg_index, seg in enumerate(shard.segments):
            ranges = seen[seg_index]
            assert ranges[0][0] == seg.offset and ranges[-1][1] == seg.offset + seg.nbytes
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("bad", [0, -16, 8, 100])
def test_chunk_pieces_refuses_a_chunk_size_that_could_split_an_element(bad):
    from torchrelay.train.ps.server import chunk_pieces

    with pytest.raises(ValueError, match=f"chunk_bytes={bad}"):
        chunk_pieces(make_plan(LAYOUTS["mlp"], 1).shard(0), bad)
