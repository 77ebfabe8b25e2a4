"""Training data for `memsched train`: arrays by input name, cut into the plan's batches.

A data file is an `.npz` with one array per input of the step, named as the input, samples
along the first axis (`np.savez("train.npz", input=images, labels=labels)`). Each array must
have the same number of samples and each sample the shape the step declares; a dtype of the
same kind is cast once on load (float64 images for a float32 step, int32 labels for int64),
any other is refused.

`batches` gives one epoch's batches in order: shuffled by a generator seeded with
(seed, epoch), so an epoch's order never depends on what ran before it (a resumed run sees
the same batches). The last partial batch is dropped (`last="drop"`, PyTorch's
`drop_last=True`) or filled up with the epoch's first samples (`last="pad"`, as
DistributedSampler pads): the batch size is the plan's. `rank`/`world` give each of `world`
data-parallel ranks its own strided share of every epoch's order (DistributedSampler's rule).
"""
from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import UserError

LAST = ("drop", "pad")


def load_arrays(path: str | os.PathLike, types: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """The arrays of data file `path` for the inputs in `types` (name -> (dtype, shape with
    the batch first)), checked and cast (module doc). UserError for a bad file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such data file: {path}")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):      # one .npy array, whatever the file's name
            raise UserError(f"{path} holds one array (a .npy file), not named arrays; write the data with "
                            f"numpy.savez(path, {'=..., '.join(types)}=...)")
        with archive:
            names = list(archive.files)
            missing = [name for name in types if name not in names]
            if missing:
                raise UserError(f"{path} has no array '{missing[0]}' (the step's inputs: {', '.join(types)}; "
                                f"the file's arrays: {', '.join(names) or 'none'})")
            arrays = {name: archive[name] for name in types}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UserError(f"{path} is not a readable .npz file: {str(exc).splitlines()[0] if str(exc) else exc}") \
            from None
    counts = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
    if len(set(counts.values())) != 1:
        shown = ", ".join(f"{name} {n}" for name, n in counts.items())
        raise UserError(f"{path}: the arrays hold different numbers of samples ({shown})")
    result = {}
    for name, (dtype, shape) in types.items():
        array = arrays[name]
        if array.ndim != len(shape) or array.shape[1:] != tuple(shape[1:]):
            raise UserError(f"{path}: '{name}' holds samples of shape {array.shape[1:]}; the step's are "
                            f"{tuple(shape[1:])}")
        if array.dtype != dtype:
            if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                raise UserError(f"{path}: '{name}' is {array.dtype}; the step needs {dtype}")
            array = array.astype(dtype)
        result[name] = np.ascontiguousarray(array)
    samples = next(iter(counts.values()))
    if samples == 0:
        raise UserError(f"{path} holds no samples")
    return result


def sample_count(arrays: dict[str, np.ndarray]) -> int:
    return next(iter(arrays.values())).shape[0]


def steps_per_epoch(samples: int, batch_size: int, last: str = "drop", world: int = 1) -> int:
    """Batches one rank takes per epoch."""
    per_rank = -(-samples // world) if last == "pad" else samples // world
    return -(-per_rank // batch_size) if last == "pad" else per_rank // batch_size


def epoch_order(samples: int, epoch: int, shuffle: bool, seed: int) -> np.ndarray:
    """The sample indices of `epoch` in order."""
    if not shuffle:
        return np.arange(samples)
    return np.random.default_rng([seed, epoch]).permutation(samples)


def batches(arrays: dict[str, np.ndarray], batch_size: int, epoch: int, *, shuffle: bool = False, seed: int = 0,
            last: str = "drop", rank: int = 0, world: int = 1, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """One epoch's batches for `rank` of `world`, from batch `start` on (module doc)."""
    if last not in LAST:
        raise UserError(f"the last partial batch is dropped or padded ('drop', 'pad'), not '{last}'")
    samples = sample_count(arrays)
    order = epoch_order(samples, epoch, shuffle, seed)
    count = steps_per_epoch(samples, batch_size, last, world)
    if count == 0:
        raise UserError(f"{samples} samples make no full batch of {batch_size} per rank; pass --last pad, or give "
                        f"more data")
    needed = count * batch_size * world
    if needed > len(order):                     # pad: wrap around to the epoch's first samples
        order = np.resize(order, needed)
    mine = order[rank:needed:world]
    for k in range(start, count):
        index = mine[k * batch_size:(k + 1) * batch_size]
        yield {name: array[index] for name, array in arrays.items()}
