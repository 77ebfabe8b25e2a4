"""The epoch loop of `memsched train`: a Trainer over a data set, with validation, checkpoints,
a resume point, the inference model and the loss curve.

`fit` runs `epochs` epochs of `data.batches` through the trainer. After each epoch it
evaluates the inference model on the validation data (where given) and writes the checkpoint
(where asked). A checkpoint records where the run stands (epoch and batch), the data order's
seed and whether it shuffles, so `resume` continues with the very batch that came next: a
resumed run gives the same losses, bit for bit, as one never stopped. Those fields are checked
before the trainer loads anything (`resume_position`): an epoch or batch that is no whole number,
a batch past this data's epoch, a seed, shuffle, last or world that `fit` never writes is one
UserError naming the checkpoint and the field. `stop()` is asked after
every step (the CLI's first Ctrl-C): the run then ends after that step with its checkpoint
written. A loss that is not finite ends the run with a UserError naming the step; nothing
trains on silently.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..data import LAST, batches, sample_count, steps_per_epoch
from ..errors import UserError
from ..figures import loss_curve_svg
from ..inference import VALIDATED_LOSSES, evaluate, export_inference, forward_model, inference_model
from ..onnx_utils import staged_text
from .trainer import Trainer, checkpoint_count, checkpoint_metadata


@dataclass
class FitOptions:
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0
    last: str = "drop"
    checkpoint: str | None = None       # written after every epoch and when stopped
    save: str | None = None             # the inference model, written at the end
    plot: str | None = None             # the loss curve (SVG), written at the end
    resume: str | None = None           # a checkpoint to continue from
    rank: int = 0                       # this data-parallel rank's share of every epoch (data.batches)
    world: int = 1


@dataclass
class FitResult:
    steps: int                          # steps this run took
    first_step: int                     # the trainer's step count when it began
    epochs_done: int
    stopped: bool                       # stopped early by `stop()`
    losses: list[float] = field(default_factory=list)
    validation: list[dict] = field(default_factory=list)
    written: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    samples_per_second: float = 0.0


def fit(trainer: Trainer, train: dict[str, np.ndarray], options: FitOptions,
        val: dict[str, np.ndarray] | None = None, on_step: Callable[[dict], None] | None = None,
        on_epoch: Callable[[dict], None] | None = None, stop: Callable[[], bool] = lambda: False) -> FitResult:
    """Train (module doc); `on_step` gets one record per step (step, epoch, batch, loss, lr,
    seconds, steps_per_epoch), `on_epoch` one per epoch (epoch, and val_loss / val_accuracy)."""
    if options.epochs < 1:
        raise UserError(f"--epochs must be at least 1, not {options.epochs}")
    if trainer.info.optimizer == "none":
        raise UserError("the plan's step has no optimizer (compiled with --optimizer none): it makes gradients "
                        "and trains nothing; compile it with --optimizer sgd, momentum, adam or adamw")
    if options.seed < 0:
        raise UserError(f"--seed must be 0 or more, not {options.seed}")
    if val is not None and trainer.info.loss not in VALIDATED_LOSSES:
        raise UserError(f"--val computes the cross_entropy or mse loss; this step's is {trainer.info.loss}")
    if val is not None or options.save:
        forward_model(trainer.graph)      # a model without an inference form says so before training
    per_epoch = steps_per_epoch(sample_count(train), trainer.batch_size, options.last, options.world)
    if per_epoch == 0:
        raise UserError(f"{sample_count(train)} samples make no full batch of {trainer.batch_size} (the plan's batch "
                        f"size){' per rank' if options.world > 1 else ''}; pass --last pad, or give more data")
    epoch, start = 0, 0
    if options.resume:
        epoch, start = resume_position(options.resume, options, per_epoch)
        trainer.load_checkpoint(options.resume)
    result = FitResult(0, trainer.step_count, epoch, False)
    began = time.perf_counter()

    def position(at_epoch: int, at_batch: int) -> dict[str, str]:
        return {"epoch": str(at_epoch), "batch": str(at_batch), "shuffle": str(options.shuffle),
                "seed": str(options.seed), "last": options.last, "world": str(options.world)}

    while epoch < options.epochs and not result.stopped:
        for k, batch in enumerate(batches(train, trainer.batch_size, epoch, shuffle=options.shuffle,
                                          seed=options.seed, last=options.last, rank=options.rank,
                                          world=options.world, start=start), start=start):
            step = trainer.step(batch)
            if not math.isfinite(step.loss):
                raise UserError(f"the loss is {step.loss} at step {step.step} (epoch {epoch + 1}, batch {k + 1}); "
                                f"nothing was written for this run: lower the learning rate (now {step.lr:g})")
            result.steps += 1
            result.losses.append(step.loss)
            if on_step is not None:
                on_step({"step": step.step, "epoch": epoch, "batch": k, "loss": step.loss, "lr": step.lr,
                         "seconds": step.seconds, "steps_per_epoch": per_epoch})
            if stop() and (epoch, k + 1) != (options.epochs - 1, per_epoch):
                result.stopped = True
                if options.checkpoint:
                    at = (epoch + 1, 0) if k + 1 == per_epoch else (epoch, k + 1)
                    result.written["checkpoint"] = str(trainer.save_checkpoint(options.checkpoint, position(*at)))
                break
        else:
            epoch, start = epoch + 1, 0
            result.epochs_done = epoch
            record = {"epoch": epoch - 1}
            if val is not None:
                scores = evaluate(inference_model(trainer.graph, trainer.state_dict()), val, trainer.info.loss,
                                  trainer.batch_size, device="cpu")
                record.update({f"val_{key}": value for key, value in scores.items()})
            result.validation.append(record)
            if options.checkpoint:
                result.written["checkpoint"] = str(trainer.save_checkpoint(options.checkpoint, position(epoch, 0)))
            if on_epoch is not None:
                on_epoch(record)
    result.seconds = time.perf_counter() - began
    result.samples_per_second = result.steps * trainer.batch_size / result.seconds if result.seconds else 0.0
    plot = options.plot or (f"{options.checkpoint}.loss.svg" if options.checkpoint else None)
    plot = plot if result.losses else None
    with staged_text(plot, loss_curve_svg(result.losses, result.first_step) if plot else "") as curve:
        if options.save and not result.stopped:     # the model and its loss curve land together
            result.written["model"] = str(export_inference(trainer.graph, trainer.state_dict(), options.save))
    if curve is not None:
        result.written["plot"] = str(curve)
    return result


def resume_position(path: str | os.PathLike, options: FitOptions, per_epoch: int) -> tuple[int, int]:
    """(epoch, batch) that checkpoint `path` resumes at, its data order the same as `options`'.
    Reads the metadata `fit` writes and checks each field (a checkpoint written by
    Trainer.save_checkpoint may lack them: epoch 0, batch 0, any order): a bad one, another
    data order or a batch past an epoch of `per_epoch` batches is one UserError."""
    metadata = checkpoint_metadata(path)
    position = _extra(metadata)
    epoch = checkpoint_count(path, metadata, "extra.epoch", "an epoch count", default="0")
    start = checkpoint_count(path, metadata, "extra.batch", "a batch number", default="0")
    for key, allowed in (("shuffle", ("True", "False")), ("last", LAST)):
        if key in position and position[key] not in allowed:
            raise UserError(f"the checkpoint {path} holds extra.{key} {position[key][:40]!r}; it is one of "
                            f"{', '.join(allowed)}")
    for key, what, least in (("seed", "a seed", 0), ("world", "a worker count", 1)):
        if key in position:
            checkpoint_count(path, metadata, f"extra.{key}", what, least)
    order = {"shuffle": str(options.shuffle), "seed": str(options.seed), "last": options.last,
             "world": str(options.world)}
    differs = [key for key, value in order.items() if key in position and position[key] != value]
    if differs:      # a checkpoint written by Trainer.save_checkpoint records no data order
        shown = " and ".join(f"{key} {position[key]}" for key in differs)
        raise UserError(f"{path} was written by a run with {shown}; resume with the same data "
                        f"order (--shuffle, --seed, --last, --workers)")
    if start >= per_epoch:
        raise UserError(f"the checkpoint {path} holds extra.batch {position['batch']!r}; an epoch of this data has "
                        f"{per_epoch} batches (0 to {per_epoch - 1}): resume with the data the run was given")
    return epoch, start


def _extra(metadata: dict[str, str]) -> dict[str, str]:
    """The `extra.*` fields of a checkpoint's metadata, by their own names."""
    return {key[len("extra."):]: value for key, value in metadata.items() if key.startswith("extra.")}


