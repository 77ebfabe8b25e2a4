"""What a training step's metadata says about it: the one reader of the keys the training-step
builder (passes.training) writes, for the trainer, the inference export and the reports.

- `TRAINING_KEY`: loss, optimizer, hyperparameters (compile-time values and the tensors that
  hold them), the trainable parameters in order, the extra inputs (labels or targets) and the
  buffers carried between steps (BatchNorm running statistics).
- `FORWARD_KEY`: the forward model as given to the builder, base64 ONNX, its weights as
  headers only (the step holds them under the same names).
- `GRAD_ROLES_KEY`: each backward and update op's role (`grad_roles`), which the dW/dX rule
  and the rewrites read.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError
from .ir import Graph, metadata_error, metadata_json

TRAINING_KEY = "memsched.training"
FORWARD_KEY = "memsched.forward"
GRAD_ROLES_KEY = "memsched.grad_roles"
ROLES = ("dW", "dX", "shared", "update")
# optimizer -> the states each parameter carries, `<param>.<state>`
OPTIMIZER_STATES = {"none": (), "sgd": (), "momentum": ("momentum_buffer",),
                    "adam": ("exp_avg", "exp_avg_sq", "step"), "adamw": ("exp_avg", "exp_avg_sq", "step")}


@dataclass(frozen=True)
class StepInfo:
    """A training step as its metadata describes it."""

    loss: str
    optimizer: str
    parameters: list[str]
    hyperparameters: dict[str, float]          # name -> compile-time value
    hyperparameter_tensors: dict[str, list[str]]  # name -> the 0-d tensors holding it
    buffers: list[str]                          # statics carried as `<name>.updated` besides the optimizer's
    extra_inputs: list[str]                     # labels or targets

    @property
    def states(self) -> list[str]:
        """Every optimizer state tensor, parameter by parameter."""
        return [f"{p}.{s}" for p in self.parameters for s in OPTIMIZER_STATES.get(self.optimizer, ())]

    @property
    def carried(self) -> list[str]:
        """The statics a step updates: parameters, optimizer states, buffers (a checkpoint's tensors)."""
        if self.optimizer == "none":
            return list(self.buffers)
        return [*self.parameters, *self.states, *self.buffers]


def step_info(graph: Graph) -> StepInfo:
    """The StepInfo of a training step; UserError where `graph` is none (an inference model, a
    GAN step, or a step written before hyperparameters were tensors of the step)."""
    raw = graph.metadata.get(TRAINING_KEY)
    if raw is None:
        raise UserError("the plan is not a training step (compile the model with --train)")
    info = metadata_json(raw, TRAINING_KEY, lambda v: isinstance(v, dict), "a JSON object")
    if "hyperparameters" not in info:
        raise UserError("the plan was compiled by an older memsched whose learning rate is a constant of the "
                        "step; compile the model again to train with it")
    try:
        return _step_info(info, graph)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        raise metadata_error(TRAINING_KEY, "a JSON object of the step's loss, optimizer, parameters and "
                                           "hyperparameters, naming the step's tensors") from None


def _step_info(info: dict, graph: Graph) -> StepInfo:
    """The StepInfo the training record `info` describes; raises TypeError, KeyError,
    IndexError or ValueError where a field has another type or names a tensor `graph` lacks."""
    betas = info.get("betas", [0.9, 0.999])
    values = {"lr": info["lr"], "momentum": info.get("momentum", 0.0), "beta1": betas[0], "beta2": betas[1],
              "eps": info.get("eps", 1e-8), "weight_decay": info.get("weight_decay", 0.0)}
    tensors = {name: list(ts) for name, ts in info["hyperparameters"].items()}
    result = StepInfo(loss=info["loss"], optimizer=info["optimizer"], parameters=list(info["parameters"]),
                      hyperparameters={name: float(values[name]) for name in tensors},
                      hyperparameter_tensors=tensors, buffers=list(info.get("buffers", [])),
                      extra_inputs=list(info.get("inputs", [])))
    named = [*result.parameters, *result.buffers, *result.extra_inputs, *(t for ts in tensors.values() for t in ts)]
    if not isinstance(result.loss, str) or not isinstance(result.optimizer, str) or any(
            not isinstance(n, str) or n not in graph.tensors for n in named):
        raise ValueError("a field names no tensor of the step")
    return result


def forward_proto(graph: Graph):
    """The forward model kept under FORWARD_KEY (an onnx.ModelProto, weights as headers), or
    None where the step keeps none: the one decoder of that record."""
    import base64

    import onnx

    raw = graph.metadata.get(FORWARD_KEY)
    return None if raw is None else onnx.ModelProto.FromString(base64.b64decode(raw))


def forward_output(graph: Graph) -> str | None:
    """The name of the forward model's first output (what the loss reads); None where the step
    keeps no forward model."""
    model = forward_proto(graph)
    return model.graph.output[0].name if model is not None and model.graph.output else None


def training_record(graph: Graph) -> dict:
    """The training record (`TRAINING_KEY`) as a JSON object, {} where the graph has none:
    what a pass reads of it (the optimizer). A UserError naming the field where a model
    holds something else there."""
    raw = graph.metadata.get(TRAINING_KEY)
    return {} if raw is None else metadata_json(raw, TRAINING_KEY, lambda v: isinstance(v, dict), "a JSON object")


_BUILDER_OPTIONS = {"loss": str, "optimizer": str, "lr": (int, float), "momentum": (int, float), "betas": list,
                    "eps": (int, float), "parameters": list}


def builder_options(graph: Graph) -> dict:
    """The training-step builder's options as the step's training record holds them (loss,
    optimizer, lr, momentum, betas, eps, weight_decay where set, and the trained parameters
    under `parameters`), so the step can be built again from its model; a UserError naming
    the field where one is missing or of another type."""
    stored = training_record(graph)
    for key, kind in _BUILDER_OPTIONS.items():
        if not isinstance(stored.get(key), kind) or isinstance(stored.get(key), bool):
            raise UserError(f"the plan's training options ({TRAINING_KEY}) lack a valid '{key}'")
    if not all(isinstance(p, str) for p in stored["parameters"]):
        raise UserError(f"the plan's training options ({TRAINING_KEY}) list a parameter that is not a name")
    options = {key: stored[key] for key in _BUILDER_OPTIONS}
    options["betas"] = tuple(options["betas"])
    decay = stored.get("weight_decay")
    if isinstance(decay, (int, float)) and not isinstance(decay, bool):
        options["weight_decay"] = decay
    return options


def grad_roles(graph: Graph) -> dict[str, dict]:
    """Op name -> its role as the training-step builder records it: {"role": "dW" | "dX" |
    "shared", "layer": forward op, "param": parameter} for backward ops, {"role": "update",
    "param": parameter} for updates; {} where the graph records none. A UserError naming the
    field where a model holds something else there."""
    raw = graph.metadata.get(GRAD_ROLES_KEY)
    if raw is None:
        return {}

    def valid(role) -> bool:
        return isinstance(role, dict) and role.get("role") in ROLES and role.get("param") in graph.tensors and \
            (role["role"] == "update" or isinstance(role.get("layer"), str))

    return metadata_json(raw, GRAD_ROLES_KEY, lambda v: isinstance(v, dict) and all(map(valid, v.values())),
                         'a JSON object of op names to roles ({"role", "layer", "param"})')
