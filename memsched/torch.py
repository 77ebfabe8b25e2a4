"""Export a PyTorch module as the ONNX forward model memsched builds a training step from.

Optional: only users who have torch import this module; the core of memsched never does.

Why not the default exporter: since torch 2.9, `torch.onnx.export` uses the dynamo exporter
(`dynamo=True`), which folds every BatchNormalization into the convolution before it, even
for a module in train mode (torchvision's ResNet-18 comes out with 20 Conv, no
BatchNormalization and 22 trainable tensors instead of 62). That graph is an inference graph:
training it trains another model. The legacy TorchScript exporter (`dynamo=False`) with
constant folding and initializer deduplication off keeps what training needs;
`export_for_training` calls it so:

    torch.onnx.export(module, args, "model.onnx", dynamo=False, opset_version=17,
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                      export_params=True, keep_initializers_as_inputs=True,
                      input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})

and then drops the initializers from the graph's inputs (memsched's front end does too).

What torch 2.14's legacy exporter does (checked by experiment):
- module in train mode, PRESERVE or TRAINING: BatchNormalization with training_mode=1 (and its
  two running-statistics outputs), Dropout kept; module in eval mode, PRESERVE: training_mode=0,
  Dropout left out; TRAINING forces train mode (Dropout kept whatever the module's state).
- EVAL with constant folding on (torch's default) folds BN into the Conv, whose weights then
  get names such as `onnx::Conv_27`; with folding off, or in any other mode, BN stays.
- Every BN keeps its scale, bias, running_mean and running_var as initializers named as in
  `module.state_dict()` (`bn1.weight`, `bn1.running_mean`, `layer1.0.conv1.weight`);
  `num_batches_tracked` is not exported. The node's momentum is 1 - torch's momentum (ONNX's
  convention: running = momentum * running + (1 - momentum) * batch).
- keep_initializers_as_inputs=False turns on a `deduplicate_initializers` pass which, for a
  module in eval mode, merges parameters and buffers of equal values into one initializer
  read through Identity nodes (two fresh BatchNorm2d(8): `4.weight`, `1.running_var`,
  `4.running_var` all became `1.weight`); True turns it off.
- Non-None defaults of forward parameters not given are traced as extra graph inputs
  (LlamaForCausalLM's `logits_to_keep=0` became an int64 input); `export_for_training`
  traces a forward that takes the example inputs alone.
- Exporting a module in train mode runs its forward: the exporter updates every BN's running
  statistics and num_batches_tracked and writes the updated values. `export_for_training`
  puts the buffers (and the random number generator) back as they were and writes the values
  the module had before the call.

memsched's training step treats every BatchNormalization as in train mode (batch statistics)
whatever its training_mode attribute, so the module's train/eval state decides only Dropout:
export a module in train mode to train with its Dropout, in eval mode to train without.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .dtypes import FLOAT_TYPES
from .errors import UserError
from .onnx_utils import save_model_atomic
from .outputs import check_writable

BATCH_DIM = "batch"
STATE_DICT_NAMES_KEY = "memsched.state_dict_names"
MIN_OPSET, MAX_OPSET = 13, 21
MAX_IR_VERSION = 10


def export_for_training(module, example_inputs, path, *, input_names=None, output_names=None,
                        opset: int = 17, batch_dim_symbolic: bool = True) -> str:
    """Export `module` to the ONNX file `path` as memsched trains it; return the path.

    `example_inputs`: a tensor or a tuple of tensors, the positional arguments of the forward
    (e.g. `(input_ids, attention_mask)`), traced once. `input_names` default to the forward's
    parameter names, `output_names` to `output` (one output) or `output_0`, `output_1`, ...
    With `batch_dim_symbolic`, dim 0 of every input and output is the symbolic `batch`
    (bind it with `--dim batch=N`, or dims={"batch": N}).

    The file has every BatchNormalization as a node (training_mode from the module's state;
    memsched uses batch statistics either way), every parameter and BN running statistic as
    an initializer named by its `module.state_dict()` key (none folded or merged with another
    of equal values: constant folding and deduplication are off), Dropout as the module's
    train/eval state has it, opset `opset` (13..21, default 17) and IR version at most 10.
    Should the exporter name an initializer otherwise, the model's metadata_props hold
    `memsched.state_dict_names`: JSON {onnx name: state_dict key}.
    The module's train/eval flags, buffers and random number generator state are as before.
    Written atomically (a temporary beside `path`, then a rename). Raises UserError, one
    line, for bad arguments and for a module that the exporter refuses, naming its reason.
    """
    try:
        import torch
    except ImportError:
        raise UserError("memsched.torch needs PyTorch: pip install torch") from None
    if not isinstance(module, torch.nn.Module):
        raise UserError(f"export_for_training needs a torch.nn.Module, not {type(module).__name__}")
    if not isinstance(opset, int) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise UserError(f"opset {opset!r} is not supported; give one of {MIN_OPSET}..{MAX_OPSET} (default 17)")
    args = _example_args(torch, example_inputs)
    input_names = _input_names(module, args, input_names)
    output_names = None if output_names is None else _names(output_names, "output_names")
    path = Path(path)
    check_writable(path)
    dynamic_axes = None
    if batch_dim_symbolic:
        dynamic_axes = {name: {0: BATCH_DIM} for name, arg in zip(input_names, args) if arg.dim() >= 1}
        dynamic_axes.update({name: {0: BATCH_DIM} for name in output_names or ()})
    name = type(module).__name__
    path.parent.mkdir(parents=True, exist_ok=True)
    with _module_kept(torch, module) as buffers, \
            tempfile.TemporaryDirectory(prefix=".memsched-export-", dir=path.parent) as folder, \
            torch.random.fork_rng(devices=_cuda_devices(module)), _exporter_quiet():
        exported = os.path.join(folder, "model.onnx")
        try:
            positional_forward(module)
            torch.onnx.export(module, args, exported, dynamo=False, opset_version=opset,
                              training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                              export_params=True, keep_initializers_as_inputs=True,
                              input_names=input_names, output_names=output_names, dynamic_axes=dynamic_axes)
        except Exception as exc:  # noqa: BLE001 - any exporter failure is the user's module
            raise UserError(f"cannot export {name} to ONNX: {_reason(exc)}") from exc
        model = onnx.load(exported)     # loads external data the exporter wrote for a big model

    state = {key: value.detach() for key, value in module.state_dict().items() if isinstance(value, torch.Tensor)}
    _initializers_not_inputs(model)
    _restore_buffer_values(model, buffers)
    if output_names is None:
        _rename_outputs(model)
    if batch_dim_symbolic:
        _symbolic_batch(model, input_names)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    renamed = state_dict_names(model, state)
    if renamed:
        entry = model.metadata_props.add()
        entry.key, entry.value = STATE_DICT_NAMES_KEY, json.dumps(renamed, sort_keys=True)
    return str(save_model_atomic(model, path))


@contextlib.contextmanager
def _module_kept(torch, module):
    """The module's train/eval flags, its instance's own forward (if any) and its buffers'
    values as they were before the block, put back after it; yields {key: buffer value}."""
    flags = [(m, m.training) for m in module.modules()]
    own_forward = module.__dict__.get("forward")     # an instance's own forward, put back after
    buffers = {key: b.detach().clone() for key, b in module.named_buffers()}
    try:
        yield buffers
    finally:
        module.__dict__.pop("forward", None)
        if own_forward is not None:
            module.__dict__["forward"] = own_forward
        with torch.no_grad():
            for key, b in module.named_buffers():
                if key in buffers:
                    b.copy_(buffers[key])
        for m, training in flags:
            m.training = training


@contextlib.contextmanager
def _exporter_quiet():
    """The TorchScript exporter's warnings that say nothing to a memsched user, silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*legacy TorchScript-based ONNX export", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*num_batches_tracked")
        warnings.filterwarnings("ignore", "The feature will be removed", DeprecationWarning, r"torch\.onnx")
        # batch_norm's check of the batch size (more than one value per channel) in train mode
        warnings.filterwarnings("ignore", "Converting a tensor to a Python boolean",
                                module=r"torch\.nn\.functional$")
        yield


def state_dict_names(model: onnx.ModelProto, state: dict) -> dict[str, str]:
    """{onnx name: state_dict key} for the float initializers of `model` that are not named by
    a key of `state` (a state_dict) but equal exactly one of its tensors not named in the
    model (or several that are one tied tensor). Empty where every name is kept."""
    have = {init.name for init in model.graph.initializer}
    free = {key: value for key, value in state.items() if key not in have and value.is_floating_point()}
    renamed = {}
    for init in model.graph.initializer:
        if init.name in state or init.data_type not in FLOAT_TYPES or not free:
            continue
        value = numpy_helper.to_array(init)
        matches = [key for key, t in free.items() if tuple(t.shape) == value.shape
                   and np.array_equal(t.cpu().float().numpy(), value.astype(np.float32))]
        if matches and len({free[key].data_ptr() for key in matches}) == 1:
            renamed[init.name] = matches[0]
    return renamed


def positional_forward(module) -> None:
    """Give `module` (as an instance attribute, which the caller removes) a forward that takes
    the example inputs alone. The legacy exporter appends the default of every forward parameter
    not given, and traces a non-None default as one more graph input (LlamaForCausalLM's
    `logits_to_keep=0` became an int64 input); called through `(*inputs)`, the defaults stay
    Python constants of the trace, as in a call with the positional inputs alone."""
    forward = module.forward

    def given_inputs_only(*inputs):
        return forward(*inputs)

    module.__dict__["forward"] = given_inputs_only


def _example_args(torch, example_inputs) -> tuple:
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    if not isinstance(args, (tuple, list)) or not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise UserError("example_inputs must be a tensor or a non-empty tuple of tensors "
                        "(the forward's positional arguments)")
    return tuple(args)


def _names(names, what: str) -> list[str]:
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise UserError(f"{what} must be a list of non-empty strings")
    names = list(names)
    if len(set(names)) != len(names):
        raise UserError(f"{what} has a name twice: {names}")
    return names


def _input_names(module, args: tuple, given) -> list[str]:
    if given is not None:
        names = _names(given, "input_names")
        if len(names) != len(args):
            raise UserError(f"input_names has {len(names)} names for {len(args)} example inputs")
        return names
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= len(args) and not any(p.kind == p.VAR_POSITIONAL for p in params[:len(args)]):
        return positional[:len(args)]
    return ["input"] if len(args) == 1 else [f"input_{i}" for i in range(len(args))]


def _cuda_devices(module) -> list[int]:
    return sorted({t.device.index or 0 for t in list(module.parameters()) + list(module.buffers())
                   if t.device.type == "cuda"})


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _initializers_not_inputs(model: onnx.ModelProto) -> None:
    """Drop the initializers from the graph's inputs. They are exported as inputs only because
    that turns off the exporter's `deduplicate_initializers` pass, which, for a module in eval
    mode, merges parameters of equal values into one initializer read through Identity nodes
    (a fresh BERT's LayerNorm weights, all ones, became one tensor: trained as one)."""
    initializers = {init.name for init in model.graph.initializer}
    kept = [vi for vi in model.graph.input if vi.name not in initializers]
    del model.graph.input[:]
    model.graph.input.extend(kept)


def _restore_buffer_values(model: onnx.ModelProto, buffers: dict) -> None:
    """Write the buffers' values from before the export (a train-mode forward updates BN's running
    statistics while tracing) into the initializers named by them."""
    for i, init in enumerate(model.graph.initializer):
        value = buffers.get(init.name)
        if value is not None:
            # numpy has no bfloat16: through float32, to ONNX's bfloat16 again
            value = value.cpu().float() if str(value.dtype) == "torch.bfloat16" else value.cpu()
            array = value.numpy().astype(helper.tensor_dtype_to_np_dtype(init.data_type), copy=False)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(array, init.name))


def _rename_outputs(model: onnx.ModelProto) -> None:
    """Name the graph's outputs `output` (one) or `output_<i>` instead of the exporter's numbers;
    one that is a graph input or initializer, or whose new name is taken, keeps its name."""
    graph = model.graph
    new = ["output"] if len(graph.output) == 1 else [f"output_{i}" for i in range(len(graph.output))]
    taken = _all_names(graph)
    fixed = {vi.name for vi in graph.input} | {init.name for init in graph.initializer}
    mapping = {vi.name: n for vi, n in zip(graph.output, new) if vi.name not in fixed and n not in taken}
    if mapping:
        _rename(graph, mapping)


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {vi.name for vi in list(graph.input) + list(graph.output) + list(graph.value_info)}
    names |= {init.name for init in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for attr in node.attribute:
            for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                names |= _all_names(sub)
    return names


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    for vi in list(graph.output) + list(graph.value_info):
        vi.name = mapping.get(vi.name, vi.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for attr in node.attribute:
            for sub in list(attr.graphs) + ([attr.g] if attr.HasField("g") else []):
                _rename(sub, mapping)


def _symbolic_batch(model: onnx.ModelProto, input_names: list[str]) -> None:
    """Dim 0 of every input (of `input_names`) and output is `batch`, as dynamic_axes would have it
    (the exporter names an output's otherwise, e.g. `Gemm345_dim_0`)."""
    graph = model.graph
    inputs = [vi for vi in graph.input if vi.name in input_names]
    for vi in inputs + list(graph.output):
        ttype = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and ttype.HasField("shape") and len(ttype.shape.dim) >= 1:
            ttype.shape.dim[0].dim_param = BATCH_DIM
