"""scikit-learn's digits data set (1,797 8x8 images of handwritten digits, shipped inside the
scikit-learn wheel: nothing is downloaded) as memsched training data.

`split` gives one fixed, seeded split: 1,437 samples to train on, 360 to test, as the arrays
a step of an image model reads: `input` float32 [n, 1, 8, 8] scaled to [0, 1] and `labels`
int64 [n]. `write` saves them as `train.npz` and `test.npz` for `memsched train --data`.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from memsched.errors import UserError

TRAIN_SAMPLES = 1437


def split(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test), each {'input': float32 [n, 1, 8, 8], 'labels': int64 [n]}."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UserError("the digits data set ships with scikit-learn: pip install scikit-learn") from None
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None]
    labels = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    train, test = order[:TRAIN_SAMPLES], order[TRAIN_SAMPLES:]
    return ({"input": images[train], "labels": labels[train]}, {"input": images[test], "labels": labels[test]})


def write(folder: str | os.PathLike, seed: int = 0) -> tuple[Path, Path]:
    """Write `train.npz` and `test.npz` into `folder` (atomically); return their paths."""
    from memsched.onnx_utils import write_file_atomic

    folder = Path(folder)
    paths = []
    for name, arrays in zip(("train", "test"), split(seed)):
        def save(tmp: str, arrays=arrays) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
        paths.append(write_file_atomic(folder / f"{name}.npz", save))
    return paths[0], paths[1]
