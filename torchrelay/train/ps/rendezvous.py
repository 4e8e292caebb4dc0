"""How workers find the server shards: the job's c10d store, no fixed port anywhere.

Contract:
- ``resolve_store(ctx)`` returns the key-value store every process of the job shares, first
  found of: ``ctx.store``; the default process group's store (what torchrun +
  ``init_process_group`` already built); ``RELAY_PS_STORE=host:port`` (a TCPStore
  someone else hosts, used by tests and benches). Raises ``RuntimeError`` saying what to
  provide when there is none.
- ``ShardDirectory(store, prefix)`` is the address book. A server publishes each incarnation
  of shard i as generation 1, 2, …: ``publish(i, "host:port", pid)``. ``lookup(i, newer_than)``
  blocks (up to ``timeout_s``) until a generation newer than ``newer_than`` exists and returns
  ``(generation, host, port)``. ``publish_plan`` / ``read_plan`` carry the sharding plan.
  Keys live under ``torchrelay/ps/<restart count>/`` so a torchrun restart never reads the
  previous attempt's addresses.
- ``advertised_host()`` is the address servers bind and publish: ``RELAY_PS_HOST`` if set,
  else the local address that routes to ``MASTER_ADDR`` (127.0.0.1 when that is loopback).
"""
from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any


def resolve_store(ctx: Any) -> Any:
    store = getattr(ctx, "store", None)
    if store is not None:
        return store
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    address = os.environ.get("RELAY_PS_STORE")
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise RuntimeError(f"RELAY_PS_STORE={address!r} is not host:port")
        return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=300))
    raise RuntimeError("the parameter server needs the job's store to publish addresses: call "
                       "torchrelay.train.init() (or init_process_group) first, give ctx.store, "
                       "or set RELAY_PS_STORE=host:port")


def default_prefix() -> str:
    return f"torchrelay/ps/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def advertised_host() -> str:
    explicit = os.environ.get("RELAY_PS_HOST")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:  # UDP "connect" sends nothing; it only asks the kernel which local address routes there
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class ShardDirectory:
    """Shard addresses and the plan, kept in the job's store. See the module docstring."""

    def __init__(self, store: Any, prefix: str | None = None, timeout_s: float = 300.0) -> None:
        self.store, self.prefix, self.timeout_s = store, prefix or default_prefix(), timeout_s

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def publish_plan(self, plan_json: str) -> None:
        self.store.set(self._key("plan"), plan_json)

    def read_plan(self, timeout_s: float = 1800.0) -> str:
        """The plan worker 0 published; blocks until it exists (servers start before the
        workers have built their models)."""
        self.store.wait([self._key("plan")], datetime.timedelta(seconds=timeout_s))
        return self.store.get(self._key("plan")).decode()

    def publish(self, shard: int, address: str, pid: int) -> int:
        """Publish the next generation of ``shard``; returns its number."""
        generation = self.store.add(self._key("shard", shard, "generation"), 0) + 1
        self.store.set(self._key("shard", shard, "addr", generation), f"{address}|{pid}")
        self.store.add(self._key("shard", shard, "generation"), 1)
        return generation

    def lookup(self, shard: int, newer_than: int = 0, timeout_s: float | None = None) -> tuple[int, str, int, int]:
        """``(generation, host, port, pid)`` of the newest incarnation after ``newer_than``.

        Blocks until one exists; raises ``TimeoutError`` after ``timeout_s``.
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        generation = self.store.add(self._key("shard", shard, "generation"), 0)
        want = max(generation, newer_than + 1)
        key = self._key("shard", shard, "addr", want)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no address for parameter-server shard {shard} generation {want} "
                                   f"within {self.timeout_s if timeout_s is None else timeout_s:.0f}s")
            try:
                self.store.wait([key], datetime.timedelta(seconds=min(remaining, 5.0)))
                break
            except Exception:  # the store's timeout error type differs across torch versions
                continue
        value = self.store.get(key).decode()
        address, _, pid = value.partition("|")
        host, _, port = address.rpartition(":")
        return want, host, int(port), int(pid)
