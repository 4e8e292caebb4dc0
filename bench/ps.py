"""Parameter server: transport, step time and convergence, each against its baseline in one run.

(a) push+pull of a 100 MB parameter set, one worker and one server process over 127.0.0.1,
    against raw loopback TCP (``sendall`` / ``recv_into`` of the same bytes there and back),
    alternated round by round; the PS figure includes the server's SGD update of the 100 MB.
(b) the same push+pull with a PyTorch RPC (TensorPipe) parameter server written the way
    PyTorch's parameter-server tutorial does it (``rpc_sync`` to the server's method with the
    gradients, the new parameters as the return value).
(c) step time of ``sync`` (2 workers + 1 server) over ``ddp`` (2 ranks, gloo), same MLP and
    per-worker batch, median over steps on worker 0.
(d) samples needed to bring the digits training loss under a target, ``async`` and
    ``ssp`` (s=2) over ``sync`` (2 workers + 1 server, same model, batch, Adam).

    python bench/ps.py [--repeats 5] [--only a]

``--only a`` runs part (a) alone (its RESULT then carries ``vs_raw_tcp`` only).

Prints rows, then ``RESULT {"vs_raw_tcp": …, "vs_torch_rpc": …, "sync_vs_ddp_step": …,
"async_samples_ratio": …, "ssp_samples_ratio": …}`` (ratios > 1 mean ours is faster for
(a)/(b); < 1 is better for (c)/(d)).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MB100 = 100 * 2**20
N_TENSORS = 4


# ---------------------------------------------------------------- child roles


def child_ps() -> None:
    """One rank of a PS job (RANK, WORLD_SIZE, TORCHRELAY_PS_STORE, BENCH_CFG)."""
    import torch

    import torchrelay.train.ps as ps
    from torchrelay.spec import ParameterServerStrategy

    cfg = json.loads(os.environ["BENCH_CFG"])
    strategy = ParameterServerStrategy.model_validate(cfg["strategy"])
    ctx = types.SimpleNamespace(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                strategy=strategy)
    ps.run_server_role_if_assigned(ctx)
    rank, workers = ps.worker_world(ctx)
    out: dict = {}
    if cfg["task"] == "steptime":
        model, batches = mlp_and_batches(rank, cfg)
        model, opt = ps.prepare(model, None, strategy, ctx)
        out = {"times": timed_steps(model, opt, batches)}
        opt.close()
    elif cfg["task"] == "samples":
        out = samples_to_target(rank, workers, cfg, strategy, ctx)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(out))


def mlp_and_batches(rank: int, cfg: dict):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(cfg["batch"], 512, generator=g), torch.randint(0, 10, (cfg["batch"],), generator=g))
               for _ in range(8)]
    return model, batches


def timed_steps(model, opt, batches, steps: int = 40, warmup: int = 5) -> list[float]:
    import torch

    times = []
    for i in range(steps + warmup):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def samples_to_target(rank: int, workers: int, cfg: dict, strategy, ctx) -> dict:
    import torch

    import torchrelay.train.ps as ps
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(1))
    X, y = X[perm], y[perm]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model, opt = ps.prepare(model, None, strategy, ctx)
    from torchrelay.train.ps.rendezvous import resolve_store

    store = resolve_store(ctx)
    B, target = cfg["batch"], cfg["target"]
    reached = None
    for epoch in range(cfg["epochs"]):
        if store.check(["reached"]):
            break
        for start in range(rank * B, len(X) - workers * B + 1, workers * B):
            if store.check(["reached"]):
                break
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(X[start:start + B]), y[start:start + B]).backward()
            opt.step()
            if rank == 0 and reached is None:
                with torch.no_grad():
                    loss = torch.nn.functional.cross_entropy(model(X), y).item()
                if loss <= target:
                    per_update = B * workers if strategy.mode == "sync" else B
                    reached = opt.last_version * per_update
                    store.set("reached", "1")
    opt.close()
    return {"samples": reached}


def child_ddp() -> None:
    import torch
    import torch.distributed as dist

    cfg = json.loads(os.environ["BENCH_CFG"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    host, port = os.environ["BENCH_STORE"].split(":")
    store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, batches = mlp_and_batches(rank, cfg)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    times = timed_steps(ddp, opt, batches)
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps({"times": times}))
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


def child_rpc() -> None:
    """The tutorial-style RPC parameter server and its one trainer (100 MB push+pull)."""
    import torch
    import torch.distributed.rpc as rpc

    cfg = json.loads(os.environ["BENCH_CFG"])
    rank = int(os.environ["RANK"])
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{cfg['port']}", rpc_timeout=300)
    rpc.init_rpc("ps" if rank == 0 else "trainer", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 1:
        grads = [torch.full((MB100 // 4 // N_TENSORS,), 1e-6) for _ in range(N_TENSORS)]
        ps_rref = rpc.remote("ps", RpcParameterServer, args=(N_TENSORS, MB100 // 4 // N_TENSORS))
        times = []
        for _ in range(cfg["repeats"] + 1):
            t0 = time.perf_counter()
            rpc.rpc_sync(ps_rref.owner(), RpcParameterServer.push_and_pull, args=(ps_rref, grads))
            times.append(time.perf_counter() - t0)
        Path(cfg["out"], "rpc.json").write_text(json.dumps({"times": times[1:]}))
    rpc.shutdown()


class RpcParameterServer:
    """PyTorch tutorial style: the server object owns the parameters and an optimizer."""

    def __init__(self, count: int, numel: int) -> None:
        import torch

        self.params = [torch.zeros(numel, requires_grad=True) for _ in range(count)]
        self.optimizer = torch.optim.SGD(self.params, lr=0.01)

    @staticmethod
    def push_and_pull(rref, grads):
        self = rref.local_value()
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer.step()
        return [p.detach() for p in self.params]


def child_tcp_echo() -> None:
    """Raw loopback TCP baseline: receive N bytes into a preallocated buffer, send them back."""
    cfg = json.loads(os.environ["BENCH_CFG"])
    listener = socket.create_server(("127.0.0.1", 0))
    Path(cfg["out"], "tcp_port").write_text(str(listener.getsockname()[1]))
    conn, _ = listener.accept()
    buf = bytearray(MB100)
    view = memoryview(buf)
    for _ in range(cfg["repeats"] + 1):
        got = 0
        while got < MB100:
            got += conn.recv_into(view[got:], MB100 - got)
        conn.sendall(view)
    conn.close()


# ---------------------------------------------------------------- orchestration


class Procs:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, role: str, env: dict) -> subprocess.Popen:
        full = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env)
        proc = subprocess.Popen([sys.executable, __file__, "--child", role], env=full, cwd=REPO,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            code = proc.wait(timeout=max(1, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"bench child {proc.args} exited {code}")

    def kill(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_ps(cfg: dict, workers: int, servers: int) -> list[dict]:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as out:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        procs = Procs()
        try:
            for r in range(workers + servers):
                procs.start("ps", {"RANK": str(r), "WORLD_SIZE": str(workers + servers),
                                   "TORCHRELAY_PS_STORE": f"127.0.0.1:{store.port}",
                                   "BENCH_CFG": json.dumps({**cfg, "out": out})})
            procs.wait()
        finally:
            procs.kill()
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(workers)]


def run_ddp(cfg: dict, world: int) -> list[dict]:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as out:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        procs = Procs()
        try:
            for r in range(world):
                procs.start("ddp", {"RANK": str(r), "WORLD_SIZE": str(world), "BENCH_STORE": f"127.0.0.1:{store.port}",
                                    "BENCH_CFG": json.dumps({**cfg, "out": out})})
            procs.wait()
        finally:
            procs.kill()
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def free_port() -> int:
    # TensorPipe's init_method needs a port number up front: picked free here, passed down.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rpc(repeats: int) -> list[float]:
    with tempfile.TemporaryDirectory() as out:
        procs = Procs()
        cfg = json.dumps({"repeats": repeats, "port": free_port(), "out": out})
        try:
            for r in range(2):
                procs.start("rpc", {"RANK": str(r), "BENCH_CFG": cfg})
            procs.wait()
        finally:
            procs.kill()
        return json.loads(Path(out, "rpc.json").read_text())["times"]


def run_transfer(repeats: int) -> tuple[list[float], list[float]]:
    """(a): raw TCP round trips and PS steps of the same 100 MB, alternated so both see the
    same machine load. This process is the PS worker and the TCP client; the PS server rank
    and the TCP echo peer are child processes."""
    import torch
    import torch.distributed as dist

    import torchrelay.train.ps as ps
    from torchrelay.spec import ParameterServerStrategy

    strategy = ParameterServerStrategy(kind="parameter_server", servers=1, mode="sync",
                                       optimizer={"name": "sgd", "lr": 0.01})
    with tempfile.TemporaryDirectory() as out:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        procs = Procs()
        try:
            procs.start("ps", {"RANK": "1", "WORLD_SIZE": "2", "TORCHRELAY_PS_STORE": f"127.0.0.1:{store.port}",
                               "BENCH_CFG": json.dumps({"strategy": strategy.model_dump(), "out": out})})
            procs.start("tcp", {"BENCH_CFG": json.dumps({"repeats": repeats, "out": out})})
            ctx = types.SimpleNamespace(rank=0, world_size=2, strategy=strategy, store=store)
            model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(MB100 // 4 // N_TENSORS))
                                            for _ in range(N_TENSORS)])
            model, opt = ps.prepare(model, None, strategy, ctx)
            opt.zero_grad()
            for p in model.parameters():
                p.grad.fill_(1e-6)
            port_file = Path(out, "tcp_port")
            while not port_file.exists() or not port_file.read_text():
                time.sleep(0.05)
            view = memoryview(bytearray(MB100))
            raw, ours = [], []
            with socket.create_connection(("127.0.0.1", int(port_file.read_text()))) as sock:
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    sock.sendall(view)
                    got = 0
                    while got < MB100:
                        got += sock.recv_into(view[got:], MB100 - got)
                    raw.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    opt.step()
                    ours.append(time.perf_counter() - t0)
            opt.close()
            procs.wait()
        finally:
            procs.kill()
        return raw[1:], ours[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["a"], help="run only part (a), the 100 MB push+pull vs raw TCP")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        {"ps": child_ps, "ddp": child_ddp, "rpc": child_rpc, "tcp": child_tcp_echo}[args.child]()
        return

    med = statistics.median
    gbps = lambda seconds: 2 * MB100 / seconds / 1e9  # noqa: E731  (push + pull bytes)
    print("(a)/(b) push+pull of 100 MB, 1 worker <-> 1 server, 127.0.0.1, median of", args.repeats)
    raw_times, our_times = run_transfer(args.repeats)
    raw, ours = med(raw_times), med(our_times)
    print(f"  raw TCP sendall/recv_into      {raw * 1e3:8.1f} ms  {gbps(raw):5.2f} GB/s")
    print(f"  torchrelay PS (incl. update)   {ours * 1e3:8.1f} ms  {gbps(ours):5.2f} GB/s")
    print(f"  load average {os.getloadavg()[0]:.2f}")
    if args.only == "a":
        print("RESULT " + json.dumps({"vs_raw_tcp": round(raw / ours, 3),
                                      "raw_tcp_ms": round(raw * 1e3, 1), "ps_ms": round(ours * 1e3, 1)}))
        return
    sgd = {"name": "sgd", "lr": 0.01}
    rpc = med(run_rpc(args.repeats))
    print(f"  torch RPC PS (TensorPipe)      {rpc * 1e3:8.1f} ms  {gbps(rpc):5.2f} GB/s")

    print("(c) step time, MLP 512-1024-1024-10 (1.6M params), batch 64 per worker, 2 workers")
    step_cfg = {"task": "steptime", "batch": 64}
    ddp = med(run_ddp(step_cfg, 2)[0]["times"])
    sync = med(run_ps({**step_cfg, "strategy": {"kind": "parameter_server", "servers": 1, "mode": "sync",
                                                "optimizer": sgd}}, 2, 1)[0]["times"])
    print(f"  ddp (gloo all-reduce)          {ddp * 1e3:8.2f} ms/step")
    print(f"  ps sync (1 server)             {sync * 1e3:8.2f} ms/step")

    print("(d) samples until digits training loss <= 0.15, 2 workers + 1 server, Adam lr 0.01, batch 32")
    samples = {}
    for mode, extra in (("sync", {}), ("async", {}), ("ssp", {"staleness": 2})):
        cfg = {"task": "samples", "batch": 32, "target": 0.15, "epochs": 30,
               "strategy": {"kind": "parameter_server", "servers": 1, "mode": mode,
                            "optimizer": {"name": "adam", "lr": 0.01}, **extra}}
        samples[mode] = run_ps(cfg, 2, 1)[0]["samples"]
        print(f"  {mode:5s}{'(s=2)' if mode == 'ssp' else '     '}                     {samples[mode]} samples")

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    result = {"vs_raw_tcp": ratio(raw, ours), "vs_torch_rpc": ratio(rpc, ours),
              "sync_vs_ddp_step": ratio(sync, ddp),
              "async_samples_ratio": ratio(samples["async"], samples["sync"]),
              "ssp_samples_ratio": ratio(samples["ssp"], samples["sync"])}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
