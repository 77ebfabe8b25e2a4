"""The inference model of a trained step: the forward graph the user compiled, with the
trained weights and running statistics, that a plain onnxruntime.InferenceSession runs.

The training step keeps the forward model as given in its metadata (step_info.FORWARD_KEY,
weights as headers only). Export fills every initializer from the trainer's state (or the
step's own value for one it does not train), puts each BatchNormalization in inference mode
(training_mode 0, its running-statistics outputs dropped: the step carries them itself) and
each Dropout (its training_mode input left out: off), and
makes the batch dimension symbolic where the graph allows it: where ONNX shape inference with
a symbolic batch still gives every output a symbolic first dimension (a Reshape to a fixed
batch does not), else the batch stays the plan's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import UserError
from .ir import Graph, tensor_value
from .onnx_utils import save_model_atomic
from .step_info import forward_proto

BATCH = "batch"


def inference_model(step: Graph, state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model of training step `step` with the weights in `state` (by name; the
    step's own values for the rest). UserError where the step keeps no forward model."""
    model = forward_model(step)
    for init in model.graph.initializer:
        if init.HasField("raw_data") or _has_values(init):
            continue
        value = state.get(init.name)
        if value is None:
            t = step.tensors.get(init.name)
            if t is None or not t.is_static:
                raise UserError(f"the plan holds no value for weight '{init.name}' of the forward model")
            value = tensor_value(t, step.base_dir)
        dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        init.CopyFrom(numpy_helper.from_array(np.asarray(value, dtype=dtype).reshape(tuple(init.dims)), init.name))
    _symbolic_batch(model)
    props = {p.key: p.value for p in model.metadata_props if not p.key.startswith("memsched.")}
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    return model


def forward_model(step: Graph) -> onnx.ModelProto:
    """The forward model kept in training step `step`, in inference form (BatchNormalization
    and Dropout in inference mode), its weights still headers; UserError where the step keeps
    none or the model has no inference form. Cheap: `memsched train` asks it before training."""
    model = forward_proto(step)
    if model is None:
        raise UserError("the plan keeps no forward model (compiled by an older memsched); compile it again")
    _inference_mode(model.graph)
    return model


def export_inference(step: Graph, state: Mapping[str, np.ndarray], path: str | os.PathLike) -> Path:
    """Write `inference_model(step, state)` to `path` atomically."""
    return save_model_atomic(inference_model(step, state), path)


def _has_values(init: onnx.TensorProto) -> bool:
    """Whether a header-only copy was never made of `init` (it holds its values)."""
    fields = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
    return any(len(getattr(init, f)) for f in fields) or init.data_location == onnx.TensorProto.EXTERNAL \
        or not np.prod(init.dims, dtype=np.int64)


def _inference_mode(graph: onnx.GraphProto) -> None:
    """Every BatchNormalization in inference mode with its one output (outputs of the graph that
    were running statistics dropped), every Dropout without its training_mode input (off)."""
    dropped = set()
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            kept = [a for a in node.attribute if a.name != "training_mode"]
            del node.attribute[:]
            node.attribute.extend(kept)
            dropped.update(name for name in node.output[1:] if name)
            del node.output[1:]
        elif node.op_type == "Dropout" and len(node.input) > 2:
            del node.input[2:]
    readers = {name for node in graph.node for name in node.input}
    if dropped & readers:
        raise UserError(f"the model reads BatchNormalization's running statistics "
                        f"('{sorted(dropped & readers)[0]}'); it has no inference form memsched can write")
    outputs = [o for o in graph.output if o.name not in dropped]
    del graph.output[:]
    graph.output.extend(outputs)


def _symbolic_batch(model: onnx.ModelProto) -> None:
    """Dim 0 of every input and output symbolic where shape inference agrees (module doc)."""
    graph = model.graph
    inputs = [vi for vi in graph.input if vi.type.tensor_type.shape.dim]
    batch = {vi.type.tensor_type.shape.dim[0].dim_value for vi in inputs}
    if len(batch) != 1:
        return
    trial = onnx.ModelProto()
    trial.CopyFrom(model)
    del trial.graph.value_info[:]
    for vi in list(trial.graph.input) + list(trial.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and dims[0].dim_value in batch:
            dims[0].Clear()
            dims[0].dim_param = BATCH
    try:
        inferred = onnx.shape_inference.infer_shapes(trial, strict_mode=True, data_prop=True)
    except Exception:  # noqa: BLE001 - inference refuses the symbolic batch: keep it fixed
        return
    produced = {vi.name: vi for vi in inferred.graph.value_info}
    for out in trial.graph.output:
        found = produced.get(out.name, out)
        dims = found.type.tensor_type.shape.dim
        if not dims or dims[0].dim_param != BATCH:
            return
    model.CopyFrom(trial)


VALIDATED_LOSSES = ("cross_entropy", "mse")


def evaluate(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray], loss: str, batch_size: int,
             device: str = "cpu", threads: int = 0) -> dict[str, float]:
    """The inference model's mean loss over `arrays` (the step's inputs and its labels or
    targets, by name) in a plain ONNX Runtime session, as PyTorch's eval mode computes it,
    and for cross_entropy its top-1 accuracy, both over every label (a sequence's tokens, a
    map's pixels: the class axis is the last for [N, C] and [N, L, V], axis 1 for maps, as
    the step's loss has it). The samples run `batch_size` at a time (the last batch filled up
    and cut where the model's batch is fixed)."""
    from .ort import make_session

    if loss not in VALIDATED_LOSSES:
        raise UserError(f"validation computes the cross_entropy or mse loss, not {loss}")
    session = make_session(model, device, threads)
    names = [i.name for i in session.get_inputs()]
    fixed = session.get_inputs()[0].shape[0] if isinstance(session.get_inputs()[0].shape[0], int) else None
    target = arrays["labels" if loss == "cross_entropy" else "targets"]
    samples = target.shape[0]
    total, correct, counted = 0.0, 0, 0
    for lo in range(0, samples, batch_size):
        index = np.arange(lo, min(lo + batch_size, samples))
        count = len(index)
        if fixed is not None and count < fixed:
            index = np.resize(index, fixed)
        out = session.run(None, {name: arrays[name][index] for name in names})[0][:count]
        want = target[index[:count]]
        if loss == "cross_entropy":
            scores = np.moveaxis(out, 1, -1) if out.ndim > 3 else out
            scores = scores.reshape(-1, scores.shape[-1]).astype(np.float64)
            labels = want.reshape(-1)
            shifted = scores - scores.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            total += float(-log_probs[np.arange(len(labels)), labels].sum())
            correct += int((scores.argmax(axis=1) == labels).sum())
            counted += len(labels)
        else:
            total += float(((out - want) ** 2).sum())
            counted += out.size
    result = {"loss": total / counted}
    if loss == "cross_entropy":
        result["accuracy"] = correct / counted
    return result
