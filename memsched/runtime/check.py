"""The check of a run: the unscheduled graph in one plain ONNX Runtime session (`Reference`),
its outputs compared with the plan's step by step (`compare_outputs`, `check_summary`: on
the CPU bit for bit, on CUDA within CUDA_TOLERANCE of each output's scale, never where an
output is not finite), and the statics fed back from step to step."""
import dataclasses
import math

import numpy as np
import onnx
from onnx import helper

from ..ir import Graph, Op, tensor_value
from ..ort import (
    reference_session,
)


# ---- inputs and outputs ------------------------------------------------------------------
def statics(graph: Graph) -> dict[str, np.ndarray]:
    """Every initializer's value: what a step reads besides its inputs."""
    return {t.name: tensor_value(t, graph.base_dir) for t in graph.initializers()}


def feed_back(graph: Graph, statics: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Next step's initializer values: each `<name>.updated` output replaces `<name>`."""
    result = dict(statics)
    for name in statics:
        updated = outputs.get(f"{name}.updated")
        if updated is not None and updated.shape == statics[name].shape and updated.dtype == statics[name].dtype:
            result[name] = updated
    return result


def compare_outputs(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output: max |actual - expected|, whether the two are bit-identical, the scale the
    difference is judged against on CUDA (max(1, max |expected|)), and whether every value is
    finite."""
    result = {}
    for name, want in expected.items():
        got = actual[name]
        same_bits = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
        scale = 1.0 if same_bits else _scale(want)
        if same_bits:
            diff = 0.0
        elif got.shape != want.shape:
            diff = math.inf
        else:
            d = np.abs(got.astype(np.float64) - want.astype(np.float64))
            nans = np.isnan(d)
            diff = float(d[~nans].max()) if (~nans).any() else 0.0
            if np.any(np.isnan(got.astype(np.float64)) != np.isnan(want.astype(np.float64))):
                diff = math.inf
        finite = not np.issubdtype(got.dtype, np.floating) or bool(np.isfinite(got).all())
        result[name] = {"max_abs_diff": diff, "bit_identical": same_bits, "scale": scale, "finite": finite}
    return result


def _scale(value: np.ndarray) -> float:
    """max(1, the largest finite magnitude of `value`)."""
    finite = np.abs(value.astype(np.float64)[np.isfinite(value)])
    return max(1.0, float(finite.max())) if finite.size else 1.0


def check_summary(per_step: list[dict[str, dict]], exact: bool) -> dict:
    """Pass on CPU only when bit-identical; on CUDA when every output's difference is within
    CUDA_TOLERANCE of its scale (max(1, its largest magnitude)); never where an output holds a
    NaN or an infinity (two runs that agree on garbage agree on nothing)."""
    worst: dict[str, float] = {}
    scaled: dict[str, float] = {}
    identical = True
    for step in per_step:
        for name, d in step.items():
            worst[name] = max(worst.get(name, 0.0), d["max_abs_diff"])
            scaled[name] = max(scaled.get(name, 0.0), d["max_abs_diff"] / d["scale"])
            identical &= d["bit_identical"]
    max_diff = max(worst.values(), default=0.0)
    max_scaled = max(scaled.values(), default=0.0)
    non_finite = sorted({name for step in per_step for name, d in step.items() if not d.get("finite", True)})
    passed = (identical if exact else max_scaled <= CUDA_TOLERANCE) and not non_finite
    return {"max_abs_diff": max_diff, "max_scaled_diff": max_scaled, "passed": bool(passed), "non_finite": non_finite,
            "bit_identical": bool(identical), "exact": exact, "tolerance": 0.0 if exact else CUDA_TOLERANCE,
            "steps": len(per_step), "per_output": worst}


# cuDNN/cuBLAS may pick different kernels (and sum in other orders) in two sessions; on CUDA
# each output's difference, over max(1, its largest magnitude), is compared to this.
CUDA_TOLERANCE = 1e-4


# ---- the reference run --------------------------------------------------------------------
class Reference:
    """The unscheduled graph in one plain ONNX Runtime session, initializers fed as inputs."""

    def __init__(self, graph: Graph, device: str, threads: int, tf32: bool):
        self.outputs = list(graph.outputs)
        self.session = reference_session(reference_model(graph).SerializeToString(), threads, device, tf32)

    def run(self, feeds: dict, statics: dict) -> dict[str, np.ndarray]:
        values = self.session.run(self.outputs, {**feeds, **statics})
        return dict(zip(self.outputs, values))


def reference_model(graph: Graph) -> onnx.ModelProto:
    """The graph with every initializer turned into a graph input (no constant-only kernels),
    and float16 tensors kept float16 between ops (see `_fp16_barriers`)."""
    model = _fp16_barriers(graph).to_onnx(load_external_data=False)
    g = model.graph
    infos = [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in g.initializer]
    del g.initializer[:]
    g.input.extend(infos)
    return model


def _fp16_barriers(graph: Graph) -> Graph:
    """Route every float16 tensor that one op passes to another through an Identity that is
    also a graph output.

    Why: ONNX Runtime's CPU provider runs ops without a float16 kernel in float32 between
    inserted Casts, and in a whole graph its RemoveDuplicateCastTransformer drops the
    fp32->fp16->fp32 Cast pairs between two such ops, so the intermediate stays float32 --
    more precise than the float16 tensor the graph declares, which per-op runs (and ONNX)
    round to. An Identity feeding a graph output keeps a real float16 kernel in between (it
    is not an "isolated" fp16 node that ORT forces to float32), so the Casts stay and the
    reference rounds exactly where the graph says. No kernel changes; only the rounding
    that the graph specifies is restored."""
    consumed = {t for op in graph.ops for t in op.present_inputs}
    routed = {t.name: f"{t.name}.fp16" for t in graph.tensors.values()
              if t.dtype == onnx.TensorProto.FLOAT16 and t.name in graph.producer and t.name in consumed}
    if not routed:
        return graph
    ops, tensors = [], dict(graph.tensors)
    for op in graph.ops:
        ops.append(dataclasses.replace(op, inputs=[routed.get(t, t) for t in op.inputs]))
        for t in op.present_outputs:
            if t in routed:
                ops.append(Op(f"{op.name}.{t}.fp16", "Identity", [t], [routed[t]], phase=op.phase))
                tensors[routed[t]] = dataclasses.replace(graph.tensors[t], name=routed[t], kind="output")
    return graph.replace(ops=ops, tensors=tensors, outputs=graph.outputs + list(routed.values()))
