"""Parameter server: transport, step time and convergence, each against its baseline in one run.

(a) push+pull of a 100 MB parameter set (4 float32 tensors), one worker and one server process
    on one host, against raw loopback TCP (``sendall`` / ``recv_into`` of the same bytes there
    and back), alternated round by round. The PS figure includes the server's SGD
    update of the 100 MB. Two PS rows: ``shared memory``, what a job whose shard is on the
    worker's host gets by default (payloads through the worker's sealed memfd, headers on the
    socket), and ``TCP`` (``RELAY_PS_SHM=0``: payloads on the socket, as between hosts).
    ``vs_raw_tcp`` is the TCP path's ratio (the issue's "over 127.0.0.1"),
    ``vs_raw_tcp_shm_path`` the default same-host path's. In (b) ``vs_torch_rpc`` compares
    the default paths of both sides on one host (TensorPipe's shm transport and cma channel,
    our shared memory), ``vs_torch_rpc_socket_path`` our TCP path with the same baseline.
(b) the same push+pull with a PyTorch RPC parameter server written the way PyTorch's
    parameter-server tutorial does it. Which tutorial: PyTorch has two.
    - "Implementing a Parameter Server Using Distributed RPC Framework"
      (rpc_param_server_tutorial; pytorch/examples distributed/rpc/parameter_server) keeps the
      whole model on the server: the trainer sends its inputs, gets the outputs, and
      dist_autograd + DistributedOptimizer compute and apply the gradients on the server
      over RRefs of its parameters. No gradient or parameter crosses the wire, so it has no
      100 MB push+pull to compare with and is not the baseline.
    - "Batch-updating parameter server" (rpc_async_execution tutorial; pytorch/examples
      distributed/rpc/batch/parameter_server.py) is a push/pull PS: the trainer calls
      ``rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
      args=(ps_rref, [p.grad for p in model.parameters()]))`` - one RPC whose argument is the
      list of gradient tensors - and the server, an ``@rpc.functions.async_execution``
      method, adds them into ``p.grad`` under a lock, divides by the batch-update size,
      runs ``optimizer.step()`` and ``zero_grad(set_to_none=False)``, and completes a future
      with the whole ``nn.Module``, which comes back as the RPC's return value. This is the
      baseline (``TutorialParameterServer``), kept as written, with these choices: one
      trainer, so batch_update_size = 1 (each push is applied, as our sync mode with one
      worker); the model is 4 x 25 MB parameters (the same bytes as ours, 100 MB each way);
      the optimizer is plain SGD lr 0.01 on both sides (the tutorial's momentum 0.9 would add
      a momentum pass to both, so it is left out of both); TensorPipe backend with its
      defaults, as the tutorial (no ``_transports``/``_channels``: on one host TensorPipe
      prefers its shm transport and the cma channel, process_vm_readv), 16 worker threads.
      (a) and (b) run in alternating blocks (``--blocks``), each with only its own processes
      alive (TensorPipe polls while idle). A second row, ``lean``,
      assigns ``p.grad = g`` and skips the average and zero_grad passes: TensorPipe's own cost,
      so the ratio cannot be won on the tutorial's extra memory passes; RESULT carries both.
(c) step time of ``sync`` (2 workers + 1 server) over ``ddp`` (2 ranks, gloo), same MLP and
    per-worker batch, median over steps on worker 0.
(d) samples needed to bring the digits training loss under a target, ``async`` and
    ``ssp`` (s=2) over ``sync`` (2 workers + 1 server, same model, batch, Adam).

    python bench/ps.py [--repeats 5] [--only a|ab]

``--only a`` runs part (a) alone, ``--only ab`` parts (a) and (b).

Prints rows, then ``RESULT {"vs_raw_tcp": …, "vs_torch_rpc": …, "sync_vs_ddp_step": …,
"async_samples_ratio": …, "ssp_samples_ratio": …}`` plus the socket-path and lean-RPC ratios
and the raw times (ratios > 1 mean ours is faster for (a)/(b); < 1 is better for (c)/(d)).
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
import threading
from pathlib import Path

import torch
import torch.distributed.rpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _env import SERVER_PACKAGES, header_line, package_versions, result_line  # noqa: E402

MB100 = 100 * 2**20
N_TENSORS = 4


# ---------------------------------------------------------------- child roles


def child_ps() -> None:
    """One rank of a PS job (RANK, WORLD_SIZE, RELAY_PS_STORE, BENCH_CFG)."""
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


def rpc_options(port: int):
    # As the tutorial: TensorPipe with its default transports and channels (on one host it
    # prefers its shm transport and the cma channel), 16 worker threads.
    return torch.distributed.rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16, rpc_timeout=300)


def child_rpc() -> None:
    """One rank of the RPC job. Rank 0 is the tutorial's parameter-server process (it only
    hosts the ``TutorialParameterServer`` objects the trainer creates); rank 1 the trainer,
    which alternates the two variants round by round and writes their times."""
    import torch.distributed.rpc as rpc

    cfg = json.loads(os.environ["BENCH_CFG"])
    if int(os.environ["RANK"]) == 0:
        rpc.init_rpc("ps", rank=0, world_size=2, rpc_backend_options=rpc_options(cfg["port"]))
        rpc.shutdown()
        return
    trainer = RpcTrainer(cfg["port"], ("tutorial", "lean"))
    times: dict[str, list[float]] = {"rpc": [], "rpc_lean": []}
    for _ in range(cfg["repeats"] + 1):
        times["rpc"].append(trainer.step("tutorial"))
        times["rpc_lean"].append(trainer.step("lean"))
    trainer.close()
    Path(cfg["out"], "rpc.json").write_text(json.dumps({k: v[1:] for k, v in times.items()}))


class RpcTrainer:
    """The tutorial's trainer (rank 1), with one server object per variant."""

    def __init__(self, port: int, variants: tuple[str, ...]) -> None:
        import torch.distributed.rpc as rpc

        rpc.init_rpc("trainer", rank=1, world_size=2, rpc_backend_options=rpc_options(port))
        self.rrefs = {v: rpc.remote("ps", TutorialParameterServer, args=(v,)) for v in variants}
        # the tutorial's trainer starts from the server's model, then sends its .grad each step
        self.models = {v: rref.rpc_sync().get_model() for v, rref in self.rrefs.items()}
        for model in self.models.values():
            self._fill_grads(model)

    @staticmethod
    def _fill_grads(model) -> None:
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-6)

    def step(self, variant: str) -> float:
        """One push+pull; returns its seconds (the gradients of the next one are made after)."""
        import torch.distributed.rpc as rpc

        rref, model = self.rrefs[variant], self.models[variant]
        t0 = time.perf_counter()
        model = rpc.rpc_sync(rref.owner(), TutorialParameterServer.update_and_fetch_model,
                             args=(rref, [p.grad for p in model.parameters()]))
        seconds = time.perf_counter() - t0
        self._fill_grads(model)  # the returned model is a fresh copy: give it gradients
        self.models[variant] = model
        return seconds

    def close(self) -> None:
        import torch.distributed.rpc as rpc

        self.rrefs.clear()
        self.models.clear()
        rpc.shutdown()


class TutorialParameterServer:
    """The tutorial's ``BatchUpdateParameterServer`` with one trainer per update (the bench has
    one worker): gradients come in as one RPC argument (a list of tensors), are accumulated
    into ``.grad``, averaged, applied by ``torch.optim.SGD``, and the whole model is the RPC's
    return value, through an ``async_execution`` future. ``variant="lean"`` assigns the
    gradients to ``.grad`` instead (no accumulate / average / zero passes): TensorPipe's
    transport cost alone, so that (b) cannot be won by the tutorial's extra memory passes."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(MB100 // 4 // N_TENSORS))
                                             for _ in range(N_TENSORS)])
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size, self.curr_update_size = 1, 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self):
        return self.model

    @staticmethod
    @torch.distributed.rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        for p, g in zip(self.model.parameters(), grads):
            if self.variant == "lean":
                p.grad = g
            else:
                p.grad += g
        with self.lock:
            self.curr_update_size += 1
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                if self.variant != "lean":
                    for p in self.model.parameters():
                        p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                if self.variant != "lean":
                    self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def child_tcp_echo() -> None:
    """Raw loopback TCP baseline: receive N bytes into a preallocated buffer, send them back."""
    cfg = json.loads(os.environ["BENCH_CFG"])
    listener = socket.create_server((cfg.get("host", "127.0.0.1"), 0))  # bench/multihost.py: a test host's address
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


def echo_round_trip(sock: socket.socket, view: memoryview) -> float:
    """Seconds to send ``view`` to ``child_tcp_echo`` and receive it back into the same buffer."""
    t0 = time.perf_counter()
    sock.sendall(view)
    got = 0
    while got < len(view):
        got += sock.recv_into(view[got:], len(view) - got)
    return time.perf_counter() - t0


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
                                   "RELAY_PS_STORE": f"127.0.0.1:{store.port}",
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


def run_rpc(repeats: int) -> dict[str, list[float]]:
    """(b): the tutorial's RPC parameter server and its trainer, two child processes."""
    with tempfile.TemporaryDirectory() as out:
        procs = Procs()
        cfg = json.dumps({"repeats": repeats, "port": free_port(), "out": out})
        try:
            for r in range(2):
                procs.start("rpc", {"RANK": str(r), "BENCH_CFG": cfg})
            procs.wait()
        finally:
            procs.kill()
        return json.loads(Path(out, "rpc.json").read_text())


def run_transfer(repeats: int) -> dict[str, list[float]]:
    """(a): raw TCP round trips and PS steps of the same 100 MB, alternated round by round so
    all see the same machine load: ``raw``; ``shm``, our PS as a same-host job gets it by
    default (payloads through the shared region); ``tcp``, our PS with ``RELAY_PS_SHM=0``
    (payloads on the socket, as between hosts). This process is the PS worker of both PS
    jobs and the TCP client; the server ranks and the TCP echo peer are child processes."""
    import torch
    import torch.distributed as dist

    import torchrelay.train.ps as ps
    from torchrelay.spec import ParameterServerStrategy

    strategy = ParameterServerStrategy(kind="parameter_server", servers=1, mode="sync",
                                       optimizer={"name": "sgd", "lr": 0.01})
    with tempfile.TemporaryDirectory() as out:
        procs = Procs()
        opts = {}
        try:
            stores = {}
            for path in ("shm", "tcp"):
                stores[path] = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                             timeout=datetime.timedelta(seconds=120))
                procs.start("ps", {"RANK": "1", "WORLD_SIZE": "2", "RELAY_PS_STORE": f"127.0.0.1:{stores[path].port}",
                                   "BENCH_CFG": json.dumps({"strategy": strategy.model_dump(), "out": out})})
            procs.start("tcp", {"BENCH_CFG": json.dumps({"repeats": repeats, "out": out})})
            for path in ("shm", "tcp"):
                os.environ["RELAY_PS_SHM"] = "1" if path == "shm" else "0"
                ctx = types.SimpleNamespace(rank=0, world_size=2, strategy=strategy, store=stores[path])
                model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(MB100 // 4 // N_TENSORS))
                                                for _ in range(N_TENSORS)])
                model, opt = ps.prepare(model, None, strategy, ctx)
                assert [link.shm for link in opt.links] == [path == "shm"], [link.shm_declined for link in opt.links]
                opt.zero_grad()
                for p in model.parameters():
                    p.grad.fill_(1e-6)
                opts[path] = opt
            os.environ.pop("RELAY_PS_SHM")
            port_file = Path(out, "tcp_port")
            while not port_file.exists() or not port_file.read_text():
                time.sleep(0.05)
            view = memoryview(bytearray(MB100))
            times: dict[str, list[float]] = {"raw": [], "shm": [], "tcp": []}
            with socket.create_connection(("127.0.0.1", int(port_file.read_text()))) as sock:
                for _ in range(repeats + 1):
                    times["raw"].append(echo_round_trip(sock, view))
                    for path, opt in opts.items():
                        t0 = time.perf_counter()
                        opt.step()
                        times[path].append(time.perf_counter() - t0)
            for opt in opts.values():
                opt.close()
            procs.wait()
        finally:
            procs.kill()
        return {k: v[1:] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=["a", "ab"],
                        help="run only part (a), the 100 MB push+pull vs raw TCP, or (a) and (b), + the RPC baseline")
    parser.add_argument("--blocks", type=int, default=2,
                        help="(a)/(b): alternate this many blocks of --repeats rounds each")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        {"ps": child_ps, "ddp": child_ddp, "rpc": child_rpc, "tcp": child_tcp_echo}[args.child]()
        return
    versions = package_versions(SERVER_PACKAGES)
    print(header_line(versions), flush=True)

    med = statistics.median
    gbps = lambda seconds: 2 * MB100 / seconds / 1e9  # noqa: E731  (push + pull bytes)
    print(f"(a)/(b) push+pull of 100 MB, 1 worker <-> 1 server, one host, median of "
          f"{args.blocks} x {args.repeats}")
    load_before = os.getloadavg()[0]
    # (a) and (b) in alternating blocks, each with only its own processes alive: TensorPipe's
    # processes poll while idle (about 0.4 of a core each, measured here), which would slow
    # whatever ran next to them.
    times: dict[str, list[float]] = {}
    for _ in range(args.blocks):
        parts = [run_transfer(args.repeats)] + ([run_rpc(args.repeats)] if args.only != "a" else [])
        for part in parts:
            for key, values in part.items():
                times.setdefault(key, []).extend(values)
    raw, ours, ours_tcp = med(times["raw"]), med(times["shm"]), med(times["tcp"])
    print(f"  raw TCP sendall/recv_into              {raw * 1e3:8.1f} ms  {gbps(raw):5.2f} GB/s")
    print(f"  torchrelay PS, shared memory (default) {ours * 1e3:8.1f} ms  {gbps(ours):5.2f} GB/s  (incl. update)")
    print(f"  torchrelay PS, TCP (PS_SHM=0)          {ours_tcp * 1e3:8.1f} ms  {gbps(ours_tcp):5.2f} GB/s  (incl. update)")
    # the (a) is "over 127.0.0.1": vs_raw_tcp is the socket path; the same-host
    # shared-memory path is reported beside it
    part_a = {"vs_raw_tcp": round(raw / ours_tcp, 3), "vs_raw_tcp_shm_path": round(raw / ours, 3),
              "raw_tcp_ms": round(raw * 1e3, 1), "ps_ms": round(ours * 1e3, 1), "ps_tcp_ms": round(ours_tcp * 1e3, 1)}
    if args.only == "a":
        print(f"  load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
        print(result_line(part_a, versions))
        return
    rpc, rpc_lean = med(times["rpc"]), med(times["rpc_lean"])
    print(f"  torch RPC PS, tutorial (TensorPipe)    {rpc * 1e3:8.1f} ms  {gbps(rpc):5.2f} GB/s")
    print(f"  torch RPC PS, lean server update       {rpc_lean * 1e3:8.1f} ms  {gbps(rpc_lean):5.2f} GB/s")
    part_b = {"vs_torch_rpc": round(rpc / ours, 3), "vs_torch_rpc_lean": round(rpc_lean / ours, 3),
              "vs_torch_rpc_socket_path": round(rpc / ours_tcp, 3), "rpc_ms": round(rpc * 1e3, 1),
              "rpc_lean_ms": round(rpc_lean * 1e3, 1)}
    print(f"  load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.only == "ab":
        print(result_line({**part_a, **part_b}, versions))
        return
    sgd = {"name": "sgd", "lr": 0.01}

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

    result = {**part_a, **part_b, "sync_vs_ddp_step": ratio(sync, ddp),
              "async_samples_ratio": ratio(samples["async"], samples["sync"]),
              "ssp_samples_ratio": ratio(samples["ssp"], samples["sync"])}
    print(result_line(result, versions))


if __name__ == "__main__":
    main()
