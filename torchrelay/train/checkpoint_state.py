"""``TrainState``: what a resumed job needs to continue the same run, not restart its epoch.

    state = rt.TrainState(model, optimizer, loader)      # loader from rt.shard (a DistributedSampler)
    state.restore()                                      # newest good checkpoint, if any (every rank)
    for epoch in state.epochs(num_epochs):               # from the restored epoch; sets the sampler's epoch
        for x, y in state.batches():                     # the rest of this epoch; state.step += 1 each
            ...
            if rt.checkpoint_due(state.step):
                state.save()                             # every rank; async per the job's policy

Contract:
- A checkpoint holds the model's and optimizer's state dicts, ``step``, ``epoch``, ``position``
  (batches of ``epoch`` already trained), ``extra`` (yours: numbers, strings, tensors) and, per
  rank, every RNG the rank uses: torch (CPU), CUDA (each device, when initialised), numpy's
  global one and Python's ``random``, plus the torch RNG as it was when this epoch's data
  iterator was made (the DataLoader draws its workers' seeds from it).
- A loader that keeps its own position (``train.resumable.ResumableStream``, e.g. ``rt.stream``)
  is saved per rank as its ``state_dict()`` and resumed with ``load_state_dict``: no batch is
  read again. Otherwise:
- Resuming mid-epoch makes the data iterator from that epoch-start RNG, skips the ``position``
  batches already trained (they are read, not trained on), then puts every RNG back as it was
  at the save: the batches, their order, dropout masks and augmentations continue exactly as
  in an uninterrupted run with the same world size. Under local SGD, DiLoCo and final
  averaging each rank's own parameters, buffers and optimizer state come back too
  (save_checkpoint keeps them per rank), so a stop between sync points resumes exactly. With
  another world size the RNGs of ranks the checkpoint lacks are left alone (a warning says so)
  and the sampler splits differently; a checkpoint holding such per-rank replicas is refused.
- Under ``balance: throughput`` the shares of the global batch are part of the state: a
  resumed job trains the rest of its epoch with the split it had (``position`` steps of the
  global batch are behind it, whatever the split was, so no sample is seen twice or missed).
- Under fsdp ``restore()`` is a sharded load: each rank reads only its shards of the model and
  of its optimizer state (checkpoint_shards), resharding from any world size.
- ``restore()`` and ``save()`` are collective: call them on every rank. A save the store fails is
  reported and training goes on (``save``'s docstring).
"""
from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Iterator

import torch

from torchrelay.errors import StorageError
from torchrelay.train.checkpoint import load_checkpoint, save_checkpoint, wait_for_checkpoint
from torchrelay.train.checkpoint_shards import shard_target
from torchrelay.train.report import report
from torchrelay.train.resumable import is_resumable
from torchrelay.train.session import current_session

log = logging.getLogger("torchrelay.train.checkpoint")

try:  # numpy is optional for the library; its global RNG is captured when it is there
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


# ---------------------------------------------------------------- RNG states as checkpoint values


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": torch.get_rng_state(),
                           "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                      "gauss": gauss}}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = list(torch.cuda.get_rng_state_all())
    return out


def restore_rng(saved: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (the parts this process can use)."""
    torch.set_rng_state(saved["torch"].to(torch.uint8))
    python = saved.get("python")
    if python is not None:
        random.setstate((int(python["version"]), tuple(int(v) for v in python["state"].tolist()), python["gauss"]))
    numpy_state = saved.get("numpy")
    if numpy_state is not None and np is not None:
        np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32),
                             int(numpy_state["pos"]), int(numpy_state["has_gauss"]), float(numpy_state["cached"])))
    cuda = saved.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.to(torch.uint8) for s in cuda])


def _rank() -> int:
    return current_session().known_context().rank


# ---------------------------------------------------------------- TrainState


class TrainState:
    """Model, optimizer, data position and RNGs of a training run, saved and restored together."""

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, loader: Any = None,
                 extra: dict[str, Any] | None = None):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.extra: dict[str, Any] = dict(extra or {})
        self.step = 0
        self.epoch = 0
        self.position = 0
        self._epoch_rng: torch.Tensor | None = None  # torch RNG just before this epoch's iterator
        self._resume_rng: dict[str, Any] | None = None  # RNGs to put back once the loader caught up
        self._resume_epoch_rng: torch.Tensor | None = None
        self.save_failures = 0  # saves the store failed (``save``); not part of a checkpoint

    # ------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """What ``save`` writes (live tensors: ``state_dict()`` shares storage)."""
        rank = f"rank-{_rank()}"
        state: dict[str, Any] = {"step": self.step, "epoch": self.epoch, "position": self.position,
                                 "model": self.model.state_dict(), "rng": {rank: capture_rng()},
                                 "extra": self.extra}
        if self._epoch_rng is not None:
            state["epoch_rng"] = {rank: self._epoch_rng}
        if is_resumable(self.loader):  # a stream keeps its own position: saved per rank, as it is
            state["data"] = {rank: self.loader.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        balancer = current_session().balancer
        if balancer is not None:
            saved = balancer.state_dict()
            state["balance"] = {"shares": torch.tensor(saved["shares"], dtype=torch.int64),
                                "resplits": saved["resplits"]}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from a loaded checkpoint. RNGs are put back now when there is no loader,
        else by ``batches()`` once the loader caught up with ``position``."""
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.epoch, self.position = int(state["step"]), int(state["epoch"]), int(state["position"])
        self.extra = dict(state.get("extra") or {})
        balancer = current_session().balancer
        if balancer is not None and "balance" in state:
            saved = state["balance"]
            balancer.load_state_dict({"shares": [int(x) for x in saved["shares"].tolist()],
                                      "resplits": int(saved["resplits"])})
        rank = f"rank-{_rank()}"
        rng = (state.get("rng") or {}).get(rank)
        if rng is None:
            log.warning("checkpoint at step %d has no RNG state for %s (saved by ranks %s): RNGs not restored",
                        self.step, rank, sorted((state.get("rng") or {})))
        self._resume_epoch_rng = (state.get("epoch_rng") or {}).get(rank)
        if is_resumable(self.loader):
            position = (state.get("data") or {}).get(rank)
            if position is None:
                raise ValueError(f"the checkpoint at step {self.step} holds no data position for {rank} (saved by "
                                 f"{sorted(state.get('data') or {})}): resuming would repeat or skip samples")
            self.loader.load_state_dict(position)
        if self.loader is None:
            if rng is not None:
                restore_rng(rng)
        else:
            self._resume_rng = rng if rng is not None else {}

    def save(self, async_: bool | None = None, *, on_error: str = "report") -> str | None:
        """``save_checkpoint`` of this state at ``self.step``; its URL. Collective. With async the
        model's forward and the optimizer's step wait for the background copy by themselves.

        A save the store fails (``StorageError``: unreachable, full, refused; an async save's
        failure surfaces here, at the next save) is, with ``on_error="report"``, logged with the
        URL and the cause and reported as the metrics ``checkpoint_failures`` (so far) and
        ``checkpoint_failed_step`` (``relay status`` shows them); training goes on to its next
        checkpoint and this returns None. Every rank sees the same failure, so all go on alike.
        ``on_error="raise"`` raises it. ``StaleAttempt`` is always raised."""
        if on_error not in ("report", "raise"):
            raise ValueError(f"on_error={on_error!r} must be 'report' or 'raise'")
        guard = [self.model] + ([self.optimizer] if self.optimizer is not None else [])
        try:
            in_flight = current_session().checkpoint.in_flight
            try:
                wait_for_checkpoint()  # the previous async save: its failure is reported as its own step's
            except StorageError as exc:
                self._save_failed(in_flight.step if in_flight is not None else self.step, exc, on_error)
            return save_checkpoint(self.state_dict(), self.step, async_=async_, guard=guard)
        except StorageError as exc:
            self._save_failed(self.step, exc, on_error)
            return None

    def _save_failed(self, step: int, exc: StorageError, on_error: str) -> None:
        if on_error == "raise":
            raise exc
        self.save_failures += 1
        log.error("checkpoint of step %d failed, training goes on to the next one: %s", step, exc)
        report(self.step, checkpoint_failures=self.save_failures, checkpoint_failed_step=step)

    def restore(self) -> bool:
        """Load the newest checkpoint that verifies; False (nothing changed) when there is none. Collective.

        Under fsdp (a model holding DTensors) each rank reads only its own shards of the model's
        parameters and their optimizer state, whatever world size saved them (checkpoint_shards)."""
        loaded = load_checkpoint(target=lambda: shard_target(self.model, self.optimizer))
        if loaded is None:
            return False
        self.load_state_dict(loaded[0])
        return True

    # ------------------------------------------------------------ iteration

    def epochs(self, total: int) -> Iterator[int]:
        """Epochs ``self.epoch … total - 1``; sets the loader's sampler epoch before each."""
        while self.epoch < total:
            sampler = self.loader if is_resumable(self.loader) else getattr(self.loader, "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
            yield self.epoch
            self.epoch += 1
            self.position = 0

    def batches(self) -> Iterator[Any]:
        """The batches of this epoch not trained yet; ``step`` and ``position`` count each one
        before it is yielded (so inside the loop ``state.step`` is this step's number)."""
        if self.loader is None:
            raise ValueError("TrainState.batches() needs the loader: TrainState(model, optimizer, loader)")
        resume, self._resume_rng = self._resume_rng, None
        if resume is not None and self._resume_epoch_rng is not None:
            torch.set_rng_state(self._resume_epoch_rng.to(torch.uint8))  # the same worker seeds as then
        self._resume_epoch_rng = None
        self._epoch_rng = torch.get_rng_state()
        iterator = iter(self.loader)
        if resume is not None and not is_resumable(self.loader):  # a stream resumed at its position itself
            skipped = sum(1 for _ in itertools.islice(iterator, self.position))
            if skipped != self.position:
                raise ValueError(f"the checkpoint is {self.position} batches into epoch {self.epoch} but the "
                                 f"loader has only {skipped}: a different dataset, batch size or world size?")
        if resume:
            restore_rng(resume)
        for batch in iterator:
            self.position += 1
            self.step += 1
            yield batch
