"""torchrelay: a distributed training platform for PyTorch.

Pieces: ``torchrelay.server`` (state, scheduling, HTTP API), ``torchrelay.agent`` (one per
node, starts workers), ``torchrelay.client`` (SDK and the ``relay`` CLI) and
``torchrelay.train`` (used inside worker processes). See DESIGN.md for the map.
"""
__version__ = "0.1.0"
