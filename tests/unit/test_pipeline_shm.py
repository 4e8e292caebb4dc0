"""The shared-memory transport's parts (shm.py) in one process: slots shared by two maps of
one file, slots with independent autograd version counters, and signals over a real socket
pair that fail at once when the peer's end closes. The two-process path runs in
tests/integration/test_pipeline.py (every lean case there uses it)."""
from __future__ import annotations

import os
import socket

import pytest
import torch

from torchrelay.train.pipeline.shm import NeighbourChannel, SlotRegion

pytestmark = pytest.mark.timeout(30)

LAYOUT = [((4, 3), torch.float32), ((2, 3), torch.float32), ((5,), torch.int64)]


@pytest.fixture
def region_path(tmp_path):
    return str(tmp_path / "slots.buf")


def test_two_maps_of_a_region_share_every_slot(region_path):
    writer, reader = SlotRegion(region_path, LAYOUT), SlotRegion(region_path, LAYOUT)
    for i, (shape, dtype) in enumerate(LAYOUT):
        assert writer.acts[i].shape == shape and writer.acts[i].dtype == dtype
        assert writer.grads[i].shape == shape and writer.grads[i].dtype == dtype
        writer.acts[i].copy_(torch.arange(torch.Size(shape).numel()).view(shape))
        writer.grads[i].fill_(i + 7)
    for i in range(len(LAYOUT)):
        assert torch.equal(reader.acts[i], writer.acts[i])
        assert torch.equal(reader.grads[i], writer.grads[i])
    # slots do not overlap: rewriting one leaves the others alone
    writer.acts[1].fill_(-1)
    assert torch.equal(reader.acts[0].view(-1), torch.arange(12, dtype=torch.float32))
    assert torch.equal(reader.grads[0], torch.full((4, 3), 7.0))


def test_writing_a_gradient_slot_does_not_invalidate_a_saved_activation(region_path):
    region = SlotRegion(region_path, LAYOUT)
    region.acts[0].fill_(2.0)
    weight = torch.ones(3, 3, requires_grad=True)
    x = region.acts[0].detach().requires_grad_()
    loss = (x @ weight).sum()  # autograd saves x (the activation slot)
    region.grads[0].copy_(torch.ones(4, 3))  # what the runtime does mid-step
    loss.backward()  # would raise "modified by an inplace operation" on shared versions
    assert torch.equal(weight.grad, torch.full((3, 3), 8.0))


def test_channel_reads_batch_signals_and_fail_when_the_peer_closes():
    left, right = socket.socketpair()
    a = NeighbourChannel(1, left, "unused", lower=True, timeout_s=5)
    b = NeighbourChannel(0, right, "unused", lower=False, timeout_s=5)
    a.write(b"FFF")
    got = b""
    while len(got) < 3:
        got += b.read_some(3 - len(got))
    assert got == b"FFF"
    a.write(b"0123456789")
    assert b.read_exact(10) == b"0123456789"
    a.close()
    with pytest.raises(RuntimeError, match="rank 0 closed"):
        b.read_some(1)
    b.close()


def test_channel_read_times_out_naming_the_peer():
    left, right = socket.socketpair()
    b = NeighbourChannel(3, right, "unused", lower=False, timeout_s=0.05)
    with pytest.raises(RuntimeError, match="nothing from rank 3"):
        b.read_some(1)
    left.close()
    b.close()


def test_open_region_handshake_maps_both_sides_and_unlinks(tmp_path):
    import threading

    left, right = socket.socketpair()
    prefix = str(tmp_path / "pair")
    lower = NeighbourChannel(1, left, prefix, lower=True, timeout_s=5)
    upper = NeighbourChannel(0, right, prefix, lower=False, timeout_s=5)
    regions = {}
    thread = threading.Thread(target=lambda: regions.update(up=upper.open_region(("k",), LAYOUT)))
    thread.start()
    regions["low"] = lower.open_region(("k",), LAYOUT)
    thread.join(5)
    assert not os.path.exists(f"{prefix}-0.buf")  # unlinked once both have mapped it
    regions["low"].acts[0].fill_(3.0)
    assert torch.equal(regions["up"].acts[0], torch.full((4, 3), 3.0))
    assert lower.regions[("k",)] is regions["low"] and upper.regions[("k",)] is regions["up"]
    lower.close()
    upper.close()
