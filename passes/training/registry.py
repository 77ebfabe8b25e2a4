"""The registry of gradient rules, keyed by ONNX op type.

A rule is a function `grad(em, op, dys, wants) -> list[str | None]`: given the Emitter,
the forward op, the gradient of each of its outputs (None where an output does not reach
the loss) and, per input, whether that input needs a gradient, it emits the backward ops
and returns one gradient tensor name per input (None where none is wanted).

Optional parts of a rule:
- `inputs`: the input positions a gradient can flow into (default: every float input);
  the others (shapes, indices, bounds, exponents given as constants) never get one;
- `outputs`: the output positions a gradient can flow out of (default: every float
  output); BN running statistics, LayerNormalization's mean, ... carry none, as in PyTorch;
- `check(em, op) -> str | None`: why this particular node cannot be differentiated
  (an unsupported attribute, a non-constant pad width), checked for every node first;
- `forward(em, op, needed)`: emits the node's forward form for training (BatchNormalization
  with batch statistics, MaxPool with its Indices output, ...) instead of copying it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from memsched.dtypes import FLOAT_TYPES


@dataclass(frozen=True)
class Rule:
    grad: Callable
    inputs: tuple[int, ...] | None = None
    outputs: tuple[int, ...] | None = None
    check: Callable | None = None
    forward: Callable | None = None


RULES: dict[str, Rule] = {}


def rule(*op_types: str, inputs: tuple[int, ...] | None = None, outputs: tuple[int, ...] | None = None,
         check: Callable | None = None, forward: Callable | None = None):
    """Register the decorated gradient function for `op_types` ("domain.type" for memsched's own ops)."""
    def register(grad: Callable) -> Callable:
        for op_type in op_types:
            RULES[op_type] = Rule(grad, inputs, outputs, check, forward)
        return grad
    return register


def rule_of(op) -> Rule | None:
    """The rule of `op`: a default-domain op's by its type, one of memsched's own ops
    (memsched.onnx_utils.MEMSCHED_DOMAIN) by "domain.type"; None where there is none."""
    return RULES.get(op.op_type if op.domain in ("", "ai.onnx") else f"{op.domain}.{op.op_type}")


def differentiable_positions(op, tensors) -> list[int]:
    """Input positions of `op` a gradient may flow into: float inputs the rule allows."""
    return _float_positions(op.inputs, _allowed(op, "inputs"), tensors)


def differentiable_outputs(op, tensors) -> list[str]:
    """Outputs of `op` a gradient may flow out of: float outputs the rule allows."""
    return [op.outputs[i] for i in _float_positions(op.outputs, _allowed(op, "outputs"), tensors)]


def _allowed(op, field: str):
    known = rule_of(op)
    allowed = getattr(known, field) if known is not None else None
    return range(len(op.inputs if field == "inputs" else op.outputs)) if allowed is None else allowed


def _float_positions(names, allowed, tensors) -> list[int]:
    return [i for i in allowed if i < len(names) and names[i] and tensors[names[i]].dtype in FLOAT_TYPES]
