"""The inference model of a trained step: the forward graph the user compiled, with the
trained weights and running statistics, that a plain onnxruntime.InferenceSession runs.

The training step keeps the forward model as given in its metadata (step_info.FORWARD_KEY,
weights as headers only). Export fills every initializer from the trainer's state (or the
step's own value for one it does not train), puts each BatchNormalization in inference mode
(training_mode 0, its running-statistics outputs dropped: the step carries them itself), and
makes the batch dimension symbolic where the graph allows it: where ONNX shape inference with
a symbolic batch still gives every output a symbolic first dimension (a Reshape to a fixed
batch does not), else the batch stays the plan's.
"""
from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import UserError
from .ir import Graph, tensor_value
from .onnx_utils import save_model_atomic
from .step_info import FORWARD_KEY

BATCH = "batch"


def inference_model(step: Graph, state: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model of training step `step` with the weights in `state` (by name; the
    step's own values for the rest). UserError where the step keeps no forward model."""
    raw = step.metadata.get(FORWARD_KEY)
    if raw is None:
        raise UserError("the plan keeps no forward model (compiled by an older memsched); compile it again")
    model = onnx.ModelProto.FromString(base64.b64decode(raw))
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
    _batch_norm_for_inference(model.graph)
    _symbolic_batch(model)
    props = {p.key: p.value for p in model.metadata_props if not p.key.startswith("memsched.")}
    del model.metadata_props[:]
    helper.set_model_props(model, props)
    return model


def export_inference(step: Graph, state: Mapping[str, np.ndarray], path: str | os.PathLike) -> Path:
    """Write `inference_model(step, state)` to `path` atomically."""
    return save_model_atomic(inference_model(step, state), path)


def _has_values(init: onnx.TensorProto) -> bool:
    """Whether a header-only copy was never made of `init` (it holds its values)."""
    fields = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data")
    return any(len(getattr(init, f)) for f in fields) or init.data_location == onnx.TensorProto.EXTERNAL \
        or not np.prod(init.dims, dtype=np.int64)


def _batch_norm_for_inference(graph: onnx.GraphProto) -> None:
    """Every BatchNormalization in inference mode with its one output; outputs of the graph
    that were running statistics are dropped."""
    dropped = set()
    for node in graph.node:
        if node.op_type != "BatchNormalization":
            continue
        kept = [a for a in node.attribute if a.name != "training_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
        dropped.update(name for name in node.output[1:] if name)
        del node.output[1:]
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


def evaluate(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray], loss: str, batch_size: int,
             device: str = "cpu", threads: int = 0) -> dict[str, float]:
    """The inference model's mean loss over `arrays` (the step's inputs and its labels or
    targets, by name) in a plain ONNX Runtime session, as PyTorch's eval mode computes it,
    and for cross_entropy its top-1 accuracy. The samples run `batch_size` at a time (the
    last batch filled up and cut where the model's batch is fixed)."""
    from .ort import make_session

    session = make_session(model, device, threads)
    names = [i.name for i in session.get_inputs()]
    fixed = session.get_inputs()[0].shape[0] if isinstance(session.get_inputs()[0].shape[0], int) else None
    target = "labels" if loss == "cross_entropy" else "targets"
    samples = next(iter(arrays.values())).shape[0]
    total, correct = 0.0, 0
    for lo in range(0, samples, batch_size):
        index = np.arange(lo, min(lo + batch_size, samples))
        count = len(index)
        if fixed is not None and count < fixed:
            index = np.resize(index, fixed)
        out = session.run(None, {name: arrays[name][index] for name in names})[0][:count]
        if loss == "cross_entropy":
            labels = arrays[target][index[:count]]
            shifted = out - out.max(axis=1, keepdims=True)
            log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
            total += float(-log_probs[np.arange(count), labels].sum())
            correct += int((out.argmax(axis=1) == labels).sum())
        elif loss == "mse" and target in arrays:
            total += float(((out - arrays[target][index[:count]]) ** 2).reshape(count, -1).mean(axis=1).sum())
        else:
            raise UserError(f"validation computes the cross_entropy or mse loss, not {loss}")
    result = {"loss": total / samples}
    if loss == "cross_entropy":
        result["accuracy"] = correct / samples
    return result
