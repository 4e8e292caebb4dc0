"""The digits example's model and data: a small CNN on sklearn's 8×8 digits (ships offline).

``load_split(seed)`` is a fixed, stratified 80/20 split of the 1,797 images, scaled to [0, 1];
the same seed gives the same split on every rank and every run.
"""
from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions, one 2×2 max-pool, two linear layers: 1×8×8 -> 10 logits."""

    def __init__(self, channels: int = 32, hidden: int = 128):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels // 2, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels // 2, channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(channels * 16, hidden), nn.ReLU(),
                                  nn.Linear(hidden, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def load_split(seed: int = 0) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """(train, test) datasets of (image 1×8×8 float32 in [0, 1], label int64)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    train_idx, test_idx = torch.tensor(train_idx), torch.tensor(test_idx)
    return (torch.utils.data.TensorDataset(images[train_idx], labels[train_idx]),
            torch.utils.data.TensorDataset(images[test_idx], labels[test_idx]))
