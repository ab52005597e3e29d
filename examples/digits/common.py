"""Model and data of the digits example, shared by ``train_engine.py`` and ``train_trainer.py``.

The data set is scikit-learn's 8x8 handwritten digits (1797 images, 10 classes); it ships
inside the scikit-learn package, so nothing is downloaded.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torch.utils.data import TensorDataset

NUM_FEATURES = 64  # 8x8 pixels
NUM_CLASSES = 10
TEST_FRACTION = 0.2


def build_model(hidden: int = 128) -> nn.Module:
    """A small MLP: 64 pixels -> hidden -> hidden -> 10 logits."""
    return nn.Sequential(
        nn.Linear(NUM_FEATURES, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, NUM_CLASSES),
    )


def build_datasets(seed: int = 0) -> Tuple[TensorDataset, TensorDataset]:
    """``(train_dataset, test_dataset)`` of ``(float32 features in [0, 1], int64 label)`` pairs.

    The split is stratified by class and fixed by ``seed``, so every process of a run
    (and every run) sees the same 1437 training and 360 test images.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    features = digits.data / 16.0  # pixel intensities are 0..16
    x_train, x_test, y_train, y_test = train_test_split(
        features, digits.target, test_size=TEST_FRACTION, stratify=digits.target, random_state=seed)

    def as_dataset(x, y) -> TensorDataset:
        return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64))

    return as_dataset(x_train, y_train), as_dataset(x_test, y_test)
