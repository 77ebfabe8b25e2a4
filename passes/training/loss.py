"""Losses appended to the forward graph (phase `loss`), each with its backward seed.

- cross_entropy: softmax cross-entropy of class logits against an int64 input `labels`
  shaped as the logits less their class axis; mean over every label. The class axis is the
  last one for [N, C] and sequence logits [N, L, V] (mean over N*L, as Hugging Face's
  language-model loss), and axis 1 for maps [N, C, H, W] / [N, C, D, H, W] (per-pixel, as
  PyTorch's CrossEntropyLoss on segmentation outputs).
- mse: mean of (output - targets)^2 over every element, `targets` shaped as the output.
- bce_with_logits: binary cross-entropy of logits against `targets` (probabilities, float,
  shaped as the output), mean over every element, in the stable form
  max(x, 0) - x * y + log(1 + exp(-|x|)) (PyTorch's BCEWithLogitsLoss); its gradient is
  (sigmoid(x) - y) / count. `bce_with_logits` also serves the GAN step with constant labels.
- output: the model's output is the loss already (it must have one element).

The loss tensor is named `loss`. Each loss returns a function that emits, in the backward
phase, the gradient of `loss` with respect to the model's output.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
from onnx import TensorProto

from memsched.errors import UserError

from memsched.dtypes import FLOAT_TYPES

LOSSES = ("cross_entropy", "mse", "bce_with_logits", "output")
LOSS_NAME = "loss"


def emit_loss(em, loss: str, output: str) -> tuple[list[str], Callable[[], str]]:
    """Emit `loss` over the model output `output`; return the extra graph inputs and the
    function that emits d loss / d output."""
    if em.dtype(output) not in FLOAT_TYPES:
        raise UserError(f"the model's output '{output}' is not a float tensor; it cannot feed a loss")
    if loss == "output":
        return _output_loss(em, output)
    for name in (LOSS_NAME, "labels" if loss == "cross_entropy" else "targets"):
        if name in em.tensors:
            raise UserError(f"the model already has a tensor named '{name}', which the training "
                            f"step needs for its {'loss' if name == LOSS_NAME else name} input")
    with em.scope("loss"):
        return {"cross_entropy": _cross_entropy, "mse": _mse, "bce_with_logits": _bce}[loss](em, output)


def _cross_entropy(em, logits):
    shape = em.shape(logits)
    if len(shape) < 2:
        raise UserError(f"cross_entropy needs class logits of rank >= 2 (classes last); the output "
                        f"'{logits}' has shape {list(shape)}")
    axis = class_axis(shape)
    label_shape = shape[:axis] + shape[axis + 1:]
    labels = em.add_input("labels", label_shape, TensorProto.INT64)
    # log softmax = logits - logsumexp(logits): only the logits are kept for the backward, never
    # a second logits-sized tensor (a language model's logits are its largest activation)
    lse = em.reduce("ReduceLogSumExp", logits, [axis], keepdims=True)
    where = em.op("Unsqueeze", [labels, em.ints([axis])])
    picked = em.op("Sub", [em.op("GatherElements", [logits, where], axis=axis), lse])
    mean = em.reduce("ReduceMean", picked, range(len(shape)), keepdims=False)
    em.op("Neg", [mean], outputs=[LOSS_NAME], kind="output")
    count = int(np.prod(label_shape))

    def backward() -> str:
        """(softmax - onehot(labels)) / count, softmax = exp(logits - logsumexp): the one-hot
        is subtracted before a division by the count (exact), not added as -1 / count
        rounded to the logits' dtype."""
        with em.scope("loss/grad"):
            probs = em.op("Exp", [em.op("Sub", [logits, lse])])
            minus = em.op("Expand", [em.scalar(-1, logits), em.ints(em.shape(where))])
            return em.divide(em.scatter_add("ScatterElements", probs, where, minus, axis=axis), count)

    return [labels], backward


def class_axis(shape) -> int:
    """Where the classes are in logits of this shape (see the module docstring)."""
    return 1 if len(shape) >= 4 else len(shape) - 1


def _mse(em, output):
    shape = em.shape(output)
    targets = em.add_input("targets", shape, em.dtype(output))
    diff = em.op("Sub", [output, targets])
    mean = em.mean_square(diff, range(len(shape)), keepdims=False)
    em.op("Identity", [mean], outputs=[LOSS_NAME], kind="output")
    count = int(np.prod(shape))

    def backward() -> str:
        with em.scope("loss/grad"):
            return em.divide(diff, count / 2)

    return [targets], backward


def _bce(em, logits):
    targets = em.add_input("targets", em.shape(logits), em.dtype(logits))
    mean, gradient = bce_with_logits(em, logits, targets)
    em.op("Identity", [mean], outputs=[LOSS_NAME], kind="output")

    def backward() -> str:
        with em.scope("loss/grad"):
            return gradient()

    return [targets], backward


def bce_with_logits(em, logits: str, targets: str) -> tuple[str, Callable[[], str]]:
    """mean(max(x, 0) - x * y + log(1 + exp(-|x|))) of logits x against targets y (a tensor
    shaped as x, or a scalar constant: one label for every element), emitted in the current
    scope; returns the mean and the function that emits d mean / d x = (sigmoid(x) - y) / count
    (in the scope current when it is called)."""
    softplus = em.op("Log", [em.op("Add", [em.op("Exp", [em.op("Neg", [em.op("Abs", [logits])])]),
                                           em.scalar(1, logits)])])
    terms = em.op("Add", [em.op("Sub", [em.op("Relu", [logits]), em.op("Mul", [logits, targets])]), softplus])
    mean = em.reduce("ReduceMean", terms, range(em.rank(logits)), keepdims=False)
    count = int(np.prod(em.shape(logits)))

    def backward() -> str:
        return em.divide(em.op("Sub", [em.op("Sigmoid", [logits]), targets]), count)

    return mean, backward


def _output_loss(em, output):
    shape = em.shape(output)
    if int(np.prod(shape)) != 1:
        raise UserError(f"--loss output needs a model whose output is a scalar loss; '{output}' has "
                        f"shape {list(shape)} (use --loss cross_entropy or mse)")
    if output != LOSS_NAME:
        if LOSS_NAME in em.tensors:
            raise UserError(f"the model already has a tensor named '{LOSS_NAME}' that is not its output")
        with em.scope("loss"):
            em.op("Identity", [output], outputs=[LOSS_NAME], kind="output")
    else:
        em.tensors[LOSS_NAME].kind = "output"

    def backward() -> str:
        return em.const(np.ones(shape, dtype=em.np_dtype(output)))

    return [], backward
