"""torchrelay: a distributed training platform for PyTorch.

Pieces: ``torchrelay.server`` (state, scheduling, HTTP API), ``torchrelay.agent`` (one per
node, starts workers), ``torchrelay.client`` (SDK and the ``relay`` CLI) and
``torchrelay.train`` (used inside worker processes). See docs/architecture.md for the map
and docs/design.md for the known hazards the code works around.
"""
__version__ = "0.1.0"
