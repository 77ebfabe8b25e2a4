"""The step a plan claims to run, built again from the user's model (`run --check --against`).

A plan file carries its own graph, so `run --check` alone can only show that the plan agrees
with itself. `model_step` rebuilds the step from the model the user gave, with the options
the plan was built with, so the executor can compare the plan's outputs with it.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnx

from memsched.errors import UserError
from memsched.frontend import lower, read_model
from memsched.ir import Graph
from memsched.schedule import Plan
from memsched.step_info import builder_options, training_record


def model_step(plan: Plan, model: str | os.PathLike) -> Graph:
    """The step of `model` that `plan` claims to run, built again from the model file: for a
    training plan, the model's training step with the options in the plan's `memsched.training`
    metadata (loss, optimizer, lr, momentum, betas, eps; the parameters the plan trains, every
    other one frozen); for a forward plan (or a model that is already a training step), the
    model itself. Symbolic dimensions take their sizes from the plan's inputs, as `--dim` did.

    The graph keeps the model's own initializers (weights), so running it beside the plan
    (`run_plan(against=...)`) shows whether the plan computes what the model does. UserError
    when the model's step does not have the plan's inputs and outputs (names, shapes, dtypes)."""
    from memsched.passes.training import TRAINING_KEY, build_training_step
    from memsched.dtypes import FLOAT_TYPES
    from memsched.passes.rewrites.batch_split import given_graph

    from memsched.emit import PLAN_KEY

    path = Path(model)
    proto = read_model(path)
    if any(p.key == PLAN_KEY for p in proto.metadata_props):
        raise UserError(f"{path} is a memsched plan; --against takes the model the plan was compiled from "
                        f"(a plan agrees with itself)")
    _check_model_inputs(proto, plan.graph, path)
    forward = lower(proto, _plan_dims(proto, plan.graph, path), base_dir=str(path.parent))
    if TRAINING_KEY not in plan.graph.metadata or TRAINING_KEY in forward.metadata:
        step, what = given_graph(forward), f"{path}"
    else:
        options = builder_options(plan.graph)
        trained = options.pop("parameters")

        def build(freeze: list[str]) -> Graph:
            try:
                return build_training_step(forward, freeze=freeze, **options)
            except UserError as exc:
                raise UserError(f"cannot build the training step of {path} with the plan's options "
                                f"({_options_text(options)}): {exc}") from None

        others = [t.name for t in forward.initializers() if t.kind == "parameter" and t.name not in trained
                  and t.dtype in FLOAT_TYPES and t.shape]
        if others:       # freeze exactly those the builder would train and the plan does not
            try:
                candidates = training_record(build([]))["parameters"]
                others = [name for name in others if name in candidates]
            except UserError:    # unbuildable with everything trained (control flow): freeze them all
                pass
        step, what = build([_fnmatch_literal(name) for name in others]), f"the training step of {path}"
    _check_same_interface(step, plan.graph, what)
    return step


def _options_text(options: dict) -> str:
    return ", ".join(f"{key} {options[key]}" for key in ("loss", "optimizer", "lr"))


def _fnmatch_literal(name: str) -> str:
    """A --freeze pattern that matches `name` only (its wildcard characters bracketed)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def _plan_dims(model: onnx.ModelProto, graph: Graph, source: Path) -> dict[str, int]:
    """The sizes the plan's inputs give the model's symbolic input dimensions."""
    dims: dict[str, int] = {}
    for vi in model.graph.input:
        shape = graph.tensors[vi.name].shape if vi.name in graph.inputs else None
        declared = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if shape is None or len(declared) != len(shape):
            continue      # _check_same_interface names the difference
        for d, size in zip(declared, shape):
            if d.HasField("dim_param") and d.dim_param:
                if dims.setdefault(d.dim_param, size) != size:
                    raise UserError(f"the plan's inputs give dimension '{d.dim_param}' of {source} two sizes "
                                    f"({dims[d.dim_param]} and {size}); the plan was not compiled from it")
    return dims


def _check_model_inputs(model: onnx.ModelProto, graph: Graph, source: Path) -> None:
    """Every input of the model is one of the plan's (a training step adds labels or targets)."""
    missing = [vi.name for vi in model.graph.input if vi.name not in graph.inputs]
    if missing:
        raise UserError(f"{source} has input '{missing[0]}', which the plan does not (the plan's inputs: "
                        f"{', '.join(graph.inputs)}); the plan was not compiled from it")


def _check_same_interface(step: Graph, graph: Graph, what: str) -> None:
    """`step` has the inputs and outputs of the plan's `graph`: the same names, shapes and dtypes."""
    for role, mine, theirs in (("input", step.inputs, graph.inputs), ("output", step.outputs, graph.outputs)):
        extra = [n for n in mine if n not in theirs]
        lacking = [n for n in theirs if n not in mine]
        if extra or lacking:
            detail = (f"has {role} '{extra[0]}', which the plan lacks" if extra
                      else f"lacks the plan's {role} '{lacking[0]}'")
            raise UserError(f"{what} {detail}; the plan was not compiled from it with these options")
        for name in theirs:
            a, b = step.tensors[name], graph.tensors[name]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise UserError(f"{what} has {role} '{name}' of shape {a.shape} ({a.dtype_name}), the plan "
                                f"{b.shape} ({b.dtype_name}); the plan was not compiled from it")

