"""A real shard server on 127.0.0.1 against hand-made messages: malformed or out-of-order
requests are refused and never touch the parameters; duplicates are answered, not reapplied."""
from __future__ import annotations

import os
import socket
import threading

import pytest
import torch

from torchrelay.spec import ServerOptimizer
from torchrelay.train.ps import protocol as P
from torchrelay.train.ps.plan import ParamSpec, make_plan
from torchrelay.train.ps.server import ShardServer, ShardState, buffers_for
from torchrelay.train.ps.shm import WorkerRegion

pytestmark = pytest.mark.timeout(30)

LAYOUT = [ParamSpec("w", "float32", (4, 3)), ParamSpec("b", "float32", (3,))]
LR = 0.5


@pytest.fixture
def shard_server():
    plan = make_plan(LAYOUT, 1)
    shard = plan.shard(0)
    opt = ServerOptimizer(name="sgd", lr=LR)
    state = ShardState.allocate(shard, buffers_for(opt), workers=2)
    server = ShardServer(shard, state, num_workers=2, mode="async", staleness=0, optimizer=opt)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def connect(server: ShardServer) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    return sock


def header(server: ShardServer, op: P.Op, **kw) -> P.Header:
    fields = {"worker": 0, "shard": 0, "step": 0, "plan_id": server.shard.plan_id, "payload_len": 0, "aux": 0}
    fields.update(kw)
    return P.Header(op, **fields)


def exchange(sock: socket.socket, raw: bytes) -> tuple[P.Header, bytes]:
    sock.sendall(raw)
    reply = P.recv_header(sock)
    return reply, P.recv_bytes(sock, reply.payload_len)


def initial_bytes(server: ShardServer) -> bytes:
    return torch.arange(server.shard.nbytes // 4, dtype=torch.float32).numpy().tobytes()


def init(server: ShardServer) -> bytes:
    data = initial_bytes(server)
    with connect(server) as sock:
        reply, _ = exchange(sock, P.pack(header(server, P.Op.INIT, payload_len=len(data))) + data)
        assert reply.op == P.Op.OK
    return data


def pull(server: ShardServer) -> bytes:
    with connect(server) as sock:
        reply, payload = exchange(sock, P.pack(header(server, P.Op.PULL)))
        assert reply.op == P.Op.PARAMS
        return payload


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def raw_header(server: ShardServer, magic=P.MAGIC, version=P.VERSION, op=int(P.Op.PUSH), flags=0,
               worker=0, shard=0, step=0, plan_id=None, length=None, aux=0) -> bytes:
    return P.HEADER.pack(magic, version, op, flags, worker, shard, step,
                         server.shard.plan_id if plan_id is None else plan_id,
                         server.shard.nbytes if length is None else length, aux)


BAD = [
    ("bad magic", dict(magic=b"XXXX"), "bad magic"),
    ("future version", dict(version=9), "protocol version 9"),
    ("unknown op", dict(op=99), "unknown op 99"),
    ("reply op from a worker", dict(op=int(P.Op.PARAMS)), "not a request"),
    ("flags set", dict(flags=1), "flags"),
    ("other shard", dict(shard=3), "shard 3"),
    ("other model layout", dict(plan_id=12345), "plan_id"),
    ("worker out of range", dict(worker=7), "worker 7"),
    ("short payload length", dict(length=8), "expects exactly"),
    ("huge payload length", dict(length=1 << 40), "expects exactly"),
    ("clock from the future", dict(step=5), "out of order"),
    ("hello with wrong worker count", dict(op=int(P.Op.HELLO), length=0, aux=3), "3 workers"),
]


@pytest.mark.parametrize("name,fields,reason", BAD, ids=[b[0] for b in BAD])
def test_malformed_or_out_of_order_request_is_refused_and_params_untouched(shard_server, name, fields, reason):
    before = init(shard_server)
    grad = torch.ones(shard_server.shard.nbytes // 4, dtype=torch.float32).numpy().tobytes()
    with connect(shard_server) as sock:
        raw = raw_header(shard_server, **fields)
        length = P.HEADER.unpack(raw)[8]
        payload = grad if length == len(grad) else b""
        reply, message = exchange(sock, raw + payload)
        assert reply.op == P.Op.ERROR
        assert reason in message.decode(), message
        assert closed_by_peer(sock)
    assert pull(shard_server) == before
    assert shard_server.version == 0


def test_truncated_payload_is_dropped_without_touching_params(shard_server):
    before = init(shard_server)
    with connect(shard_server) as sock:
        sock.sendall(raw_header(shard_server) + b"\x00" * (shard_server.shard.nbytes // 2))
    # the server notices the close mid-payload; nothing was applied
    assert pull(shard_server) == before
    assert shard_server.version == 0


def test_push_before_init_is_refused(shard_server):
    with connect(shard_server) as sock:
        reply, message = exchange(sock, raw_header(shard_server) + b"\x00" * shard_server.shard.nbytes)
    assert reply.op == P.Op.ERROR and b"initialised" in message


def test_bad_set_state_meta_is_refused(shard_server):
    before = init(shard_server)
    meta = b"{not json"
    body = b"\x00" * shard_server.identity.state_nbytes + meta
    with connect(shard_server) as sock:
        reply, message = exchange(sock, P.pack(header(shard_server, P.Op.SET_STATE, payload_len=len(body),
                                                      aux=len(meta))) + body)
    assert reply.op == P.Op.ERROR and b"meta" in message
    assert pull(shard_server) == before


def test_good_push_applies_once_and_a_resend_is_not_reapplied(shard_server):
    before = torch.frombuffer(bytearray(init(shard_server)), dtype=torch.float32)
    grad = torch.full_like(before, 2.0)
    push = P.pack(header(shard_server, P.Op.PUSH, step=0, payload_len=shard_server.shard.nbytes))
    with connect(shard_server) as sock:
        reply, payload = exchange(sock, push + grad.numpy().tobytes())
        assert reply.op == P.Op.PARAMS and reply.step == 1
        after = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        # only the parameters' elements are updated (not the alignment padding between them)
        updated = torch.zeros_like(before, dtype=torch.bool)
        for seg in shard_server.shard.segments:
            updated[seg.offset // 4:seg.offset // 4 + seg.numel] = True
        assert not updated.all()  # the layout has padding
        torch.testing.assert_close(after[updated], before[updated] - LR * 2.0)
        torch.testing.assert_close(after[~updated], before[~updated])
        again, payload2 = exchange(sock, push + grad.numpy().tobytes())  # the same clock again
        assert again.op == P.Op.PARAMS and again.step == 1
        assert payload2 == payload
        future = P.pack(header(shard_server, P.Op.PUSH, step=7, payload_len=shard_server.shard.nbytes))
        stale, message = exchange(sock, future + grad.numpy().tobytes())
        assert stale.op == P.Op.ERROR and b"out of order" in message
    assert shard_server.version == 1


OPTIMIZERS = {
    "sgd": ServerOptimizer(name="sgd", lr=0.1),
    "sgd momentum wd": ServerOptimizer(name="sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": ServerOptimizer(name="adam", lr=0.01, weight_decay=0.01),
}


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_update_overlapped_with_the_reply_chunk_by_chunk_equals_the_whole_update(mode, opt_name):
    """The same pushes through a server that updates and replies in 16-byte chunks (tensors
    cut mid-way, many chunks) and one that does it in one piece: bit-identical replies,
    parameters and optimizer state (Adam's per-tensor step counts move once per push)."""
    layout = [ParamSpec("w", "float32", (7, 5)), ParamSpec("b", "float32", (5,)), ParamSpec("h", "float64", (9,))]
    shard = make_plan(layout, 1).shard(0)
    opt = OPTIMIZERS[opt_name]
    servers, threads = [], []
    for chunk_bytes in (16, 1 << 20):
        state = ShardState.allocate(shard, buffers_for(opt), workers=1)
        server = ShardServer(shard, state, num_workers=1, mode=mode, staleness=1, optimizer=opt,
                             chunk_bytes=chunk_bytes)
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
        threads[-1].start()
        servers.append(server)
    try:
        g = torch.Generator().manual_seed(0)
        init_data = torch.randn(shard.nbytes // 4, generator=g).numpy().tobytes()
        replies: list[list[bytes]] = [[], []]
        for k, server in enumerate(servers):
            with connect(server) as sock:
                reply, _ = exchange(sock, P.pack(header(server, P.Op.INIT, payload_len=len(init_data))) + init_data)
                assert reply.op == P.Op.OK
                g = torch.Generator().manual_seed(1)
                for step in range(3):
                    grad = torch.randn(shard.nbytes // 4, generator=g).numpy().tobytes()
                    reply, payload = exchange(sock, P.pack(header(server, P.Op.PUSH, step=step,
                                                                  payload_len=len(grad))) + grad)
                    assert reply.op == P.Op.PARAMS and reply.step == step + 1
                    replies[k].append(payload)
        assert replies[0] == replies[1]
        assert replies[0][0] != replies[0][2]  # the pushes did change the parameters
        chunked, whole = (s.state for s in servers)
        assert torch.equal(chunked.params, whole.params)
        for a, b in zip(chunked.buffers, whole.buffers):
            assert torch.equal(a, b)
        assert torch.equal(chunked.steps, whole.steps)
        if opt.name == "adam":
            assert chunked.steps.tolist() == [3.0] * len(shard.segments)
    finally:
        for server, thread in zip(servers, threads):
            server.stop()
            thread.join(timeout=5)


# ---------------------------------------------------------------- shared memory (FLAG_SHM)


def attach(server: ShardServer, sock: socket.socket, region: WorkerRegion, worker: int = 0,
           payload: bytes | None = None) -> tuple[P.Header, bytes]:
    body = region.attach_payload() if payload is None else payload
    return exchange(sock, P.pack(header(server, P.Op.ATTACH, worker=worker, payload_len=len(body))) + body)


def shm_push(server: ShardServer, sock: socket.socket, step: int, worker: int = 0) -> P.Header:
    reply, payload = exchange(sock, P.pack(header(server, P.Op.PUSH, worker=worker, step=step, flags=P.FLAG_SHM)))
    assert reply.op == P.Op.PARAMS and reply.flags == P.FLAG_SHM and payload == b"", (reply, payload)
    return reply


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("opt_name", ["sgd momentum wd", "adam"])
def test_pushes_through_shared_memory_equal_pushes_over_tcp(mode, opt_name):
    """The same pushes, one server fed over TCP and one through an attached region (16-byte
    chunks, so the chunked update path copies into the region piece by piece): the
    parameters the worker gets back and the servers' whole state are bit-identical, and the
    worker's gradients are left as they were."""
    layout = [ParamSpec("w", "float32", (7, 5)), ParamSpec("b", "float32", (5,)), ParamSpec("h", "float64", (9,))]
    shard = make_plan(layout, 1).shard(0)
    opt = OPTIMIZERS[opt_name]
    servers, threads = [], []
    for _ in range(2):
        server = ShardServer(shard, ShardState.allocate(shard, buffers_for(opt), workers=1), num_workers=1,
                             mode=mode, staleness=1, optimizer=opt, chunk_bytes=16)
        threads.append(threading.Thread(target=server.serve_forever, daemon=True))
        threads[-1].start()
        servers.append(server)
    region = WorkerRegion.create(shard.nbytes)
    try:
        init_data = torch.randn(shard.nbytes // 4, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
        got: list[list[bytes]] = [[], []]
        for k, server in enumerate(servers):
            with connect(server) as sock:
                assert exchange(sock, P.pack(header(server, P.Op.INIT, payload_len=len(init_data))) + init_data)[0].op == P.Op.OK
                if k == 1:
                    reply, reason = attach(server, sock, region)
                    assert reply.op == P.Op.OK and reply.aux == 1, reason
                g = torch.Generator().manual_seed(1)
                for step in range(3):
                    grad = torch.randn(shard.nbytes // 4, generator=g).numpy().tobytes()
                    if k == 0:
                        reply, payload = exchange(sock, P.pack(header(server, P.Op.PUSH, step=step,
                                                                      payload_len=len(grad))) + grad)
                    else:
                        region.grads.copy_(torch.frombuffer(bytearray(grad), dtype=torch.uint8))
                        reply = shm_push(server, sock, step)
                        assert bytes(region.grads.numpy()) == grad  # read, never written
                        payload = bytes(region.params.numpy())
                    assert reply.step == step + 1
                    got[k].append(payload)
        assert got[0] == got[1]
        assert got[0][0] != got[0][2]
        tcp, shm = (s.state for s in servers)
        assert torch.equal(tcp.params, shm.params)
        for a, b in zip(tcp.buffers, shm.buffers):
            assert torch.equal(a, b)
    finally:
        for server, thread in zip(servers, threads):
            server.stop()
            thread.join(timeout=5)


@pytest.mark.parametrize("second_over_shm", [False, True])
def test_sync_round_mixing_shared_memory_and_tcp_applies_the_mean_and_leaves_worker_gradients(second_over_shm):
    plan = make_plan(LAYOUT, 1)
    shard = plan.shard(0)
    opt = ServerOptimizer(name="sgd", lr=LR)
    server = ShardServer(shard, ShardState.allocate(shard, buffers_for(opt), workers=2), num_workers=2,
                         mode="sync", staleness=0, optimizer=opt)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    regions = [WorkerRegion.create(shard.nbytes) for _ in range(2)]
    try:
        before = torch.frombuffer(bytearray(init(server)), dtype=torch.float32)
        grads = [torch.full_like(before, 1.0), torch.full_like(before, 3.0)]
        for region, grad in zip(regions, grads):
            region.grads.view(torch.float32).copy_(grad)
        first, second = connect(server), connect(server)
        with first, second:
            assert attach(server, first, regions[0], worker=0)[0].aux == 1
            if second_over_shm:
                assert attach(server, second, regions[1], worker=1)[0].aux == 1
            first.sendall(P.pack(header(server, P.Op.PUSH, worker=0, step=0, flags=P.FLAG_SHM)))
            while server._waiting == 0:  # worker 0 is held for the round
                threading.Event().wait(0.01)
            if second_over_shm:
                shm_push(server, second, 0, worker=1)
                after1 = regions[1].params.view(torch.float32).clone()
            else:
                reply, payload = exchange(second, P.pack(header(server, P.Op.PUSH, worker=1, step=0,
                                                                payload_len=shard.nbytes)) + grads[1].numpy().tobytes())
                after1 = torch.frombuffer(bytearray(payload), dtype=torch.float32)
            reply = P.recv_header(first)
            assert reply.op == P.Op.PARAMS and reply.flags == P.FLAG_SHM and reply.step == 1
        after0 = regions[0].params.view(torch.float32)
        updated = torch.zeros_like(before, dtype=torch.bool)
        for seg in shard.segments:
            updated[seg.offset // 4:seg.offset // 4 + seg.numel] = True
        torch.testing.assert_close(after0[updated], before[updated] - LR * 2.0)  # mean of 1 and 3
        assert torch.equal(after0, after1)
        for region, grad in zip(regions, grads):  # the sum was never kept in a worker's region
            assert torch.equal(region.grads.view(torch.float32), grad)
    finally:
        server.stop()
        thread.join(timeout=5)


def _unsealed_region(nbytes: int) -> bytes:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, 8192 + 2 * nbytes)
    _KEEP.append(fd)
    return P.pack_attach(os.getpid(), fd, 8192 + 2 * nbytes, 4096, 4096 + nbytes, b"\0" * 16)


_KEEP: list[int] = []


DECLINED = [
    ("wrong nonce", lambda r, n: P.pack_attach(os.getpid(), r.fd, r.size, r.params_offset, r.grads_offset, b"x" * 16),
     "nonce"),
    ("wrong size", lambda r, n: P.pack_attach(os.getpid(), r.fd, r.size + 4096, r.params_offset, r.grads_offset,
                                              r.nonce), "bytes; the worker said"),
    ("no such fd", lambda r, n: P.pack_attach(os.getpid(), 10**6, r.size, r.params_offset, r.grads_offset, r.nonce),
     "cannot open fd"),
    ("overlapping offsets", lambda r, n: P.pack_attach(os.getpid(), r.fd, r.size, r.params_offset, r.params_offset,
                                                       r.nonce), "do not fit"),
    ("region too small", lambda r, n: P.pack_attach(os.getpid(), r.fd, r.size, r.params_offset, r.size - 8,
                                                    r.nonce), "do not fit"),
    ("not sealed", lambda r, n: _unsealed_region(n), "not sealed"),
]


@pytest.mark.parametrize("name,make,reason", DECLINED, ids=[d[0] for d in DECLINED])
def test_a_bad_attach_is_declined_and_shared_memory_pushes_are_then_refused(shard_server, name, make, reason):
    before = init(shard_server)
    region = WorkerRegion.create(shard_server.shard.nbytes)
    region.params.fill_(7)
    with connect(shard_server) as sock:
        reply, message = attach(shard_server, sock, region, payload=make(region, shard_server.shard.nbytes))
        assert reply.op == P.Op.OK and reply.aux == 0
        assert reason in message.decode(), message
        reply, message = exchange(sock, P.pack(header(shard_server, P.Op.PUSH, flags=P.FLAG_SHM)))
        assert reply.op == P.Op.ERROR and b"no shared memory attached" in message
        assert closed_by_peer(sock)
    assert pull(shard_server) == before
    assert shard_server.version == 0
    assert bool((region.params == 7).all())  # nothing was written into the worker's memory
