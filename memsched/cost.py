"""The cost model: how long one op takes, from a roofline on a Hardware or from a measured table.

Every op has an op class (OP_CLASSES: by op type, and by shape where one efficiency cannot
fit: weight-gradient, transposed, grouped and 3-D convolutions, batched MatMuls), a FLOP count,
the bytes it moves (each input read once, each output written once; gathers read only the rows
they fetch) and, for a broadcasting elementwise op, the inner loops ONNX Runtime runs over it
(`broadcast_loops`). A calibrated profile (`memsched hardware calibrate`: the `cpu` preset, or
a GPU's own) prices a class by the line fitted to timings of that class,

    time = overhead + flops / FLOP/s + (bytes + rereads) / bandwidth + loops x loop cost

(each term where the profile has the figure; `fitted_time`, fitted by `fit_class_costs`).
`rereads` are the bytes ONNX Runtime's CPU convolutions read again: they run one GEMM per
image, so a Conv or ConvTranspose reads its kernel once per image (a 512-channel 3x3 layer of
ResNet-18 at 2x2 pixels, batch 4: 38 MB of kernel reads for 0.7 MB of activations; priced
without them, its small step's convolutions came to 0.74 of their time). Weight-gradient
convolutions loop otherwise and have none. A
class it has no line for takes its parent's (PARENT_CLASS). Other classes, and every class on
a spec-sheet profile (the GPU presets), are priced by the roofline

    time = max(flops / FLOP/s, bytes / bandwidth) + launch overhead

with the profile's per-class figures where it has them, else the peak for the op's dtype and
the device bandwidth. Shape-only ops (Reshape, Squeeze, Shape, Identity, Constant, ...)
launch no kernel: time 0.

FLOPs (one multiply-add = 2):
  Conv           2 * |Y| * (C_in/group * prod(kernel))  (+ |Y| with a bias)
  ConvTranspose  2 * |X| * (C_out/group * prod(kernel)) (+ |Y| with a bias)
  Gemm           2 * M * N * K (+ M * N with C);  MatMul (batched, broadcast) 2 * |Y| * K
  elementwise    |Y| (largest output);  reductions |X|;  pooling |Y| * prod(kernel), global |X|
  normalisation  2 |X| (BatchNorm, inference), 5 |X| otherwise (mean, var, normalise, affine)
  Softmax        4 |X| (max, exp, sum, divide);  gathers, scatters, copies and shape ops 0

Measured: a `CostTable` (written by `memsched profile`, see memsched.measure) maps each op
name to seconds, and each op signature (type, attributes, input shapes/dtypes) to seconds so
a table also prices ops it was not made from but that match one it timed.

Rewritten ops: the passes that rewrite a training step (fused updates, concat-split parts,
micro-batch copies) record what they replaced and the names of the ops they added in the
step's metadata (`passes.reuse.record_rewrite`). An added op the table has no time for is
priced from the ops it was made from: a fused update by the sum of the ops it replaces (the
dW Gemm and the update ops it fed), a part or chunk copy (`X/part0`, `X/chunk1/grad/Conv`)
by the time of `X` (`X/grad/Conv`) scaled by its share of `X`'s work (FLOPs, else the bytes
of its inputs and outputs). Added glue (the Splits, Concats and Adds around the parts) has no
source: it is priced by the roofline on the profile of the table's device (`cpu` for a CPU
table, else v100-16gb). `CostTable.pricing(graph)` says which ops were priced how. Every
other op the table lacks is an error: the table was made from another graph.

`op_time(op, graph, source)` is the one entry point: source is a Hardware or a CostTable;
`model_pricing` and `CostTable.pricing` say how a graph's ops were priced.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from . import dtypes
from .documents import read_document
from .errors import UserError
from .hardware import Hardware
from .ir import Graph, Op, Tensor, tensor_value
from .onnx_utils import write_text_atomic
from .ops import (DATA_OPS, ELEMENTWISE_OPS, EXP_REDUCTION_OPS, GATHER_OPS, NORM_OPS, POOL_OPS, REDUCTION_OPS,
                  SHAPE_OPS, SOFTMAX_OPS, TRANSCENDENTAL_OPS)

# The classes a calibrated profile may carry its own figures for. Shape classes split an op
# type where one efficiency cannot fit: transposed and grouped convolutions, batched MatMuls
# (attention) against GEMMs with a weight operand, GEMMs with few rows (FEW_ROWS) against the rest.
# Convolutions: `_wgrad` a Conv whose kernel is computed (a weight gradient: a few huge kernels),
# `_3d` three spatial dimensions.
CONV_CLASSES = ("conv", "conv_3d", "conv_wgrad", "conv_wgrad_3d", "conv_transpose", "conv_transpose_3d",
                "conv_grouped", "conv_grouped_wgrad", "conv_transpose_grouped")
OP_CLASSES = (*CONV_CLASSES, "gemm", "gemm_few_rows", "matmul_batched", "elementwise", "transcendental", "reduction",
              "reduction_exp", "pool", "norm", "softmax", "gather", "transpose", "data", "shape", "other")
# A profile without figures for a shape class prices it as its parent class (and so on up).
PARENT_CLASS = {"conv_3d": "conv", "conv_wgrad": "conv", "conv_wgrad_3d": "conv_wgrad",
                "conv_transpose": "conv", "conv_transpose_3d": "conv_transpose",
                "conv_grouped_wgrad": "conv_grouped", "conv_transpose_grouped": "conv_grouped",
                "matmul_batched": "gemm", "gemm_few_rows": "gemm", "reduction_exp": "reduction", "transpose": "data"}
# Classes whose time follows their FLOPs (and bytes); the others follow their bytes.
FLOP_CLASSES = (*CONV_CLASSES, "gemm", "gemm_few_rows", "matmul_batched")
# Classes whose broadcasts run an inner loop per span (`broadcast_loops`).
LOOP_CLASSES = ("elementwise", "transcendental")


@dataclass(frozen=True)
class OpCost:
    op_class: str
    flops: int
    bytes: int
    dtype: str      # numpy name of the dtype the arithmetic runs in
    loops: int = 0  # inner loops of a broadcasting elementwise op (`broadcast_loops`), else 0
    rereads: int = 0    # bytes read again: a convolution's kernel once per image after the first

    @property
    def fitted_bytes(self) -> int:
        """The bytes a calibrated line prices: those moved and those read again."""
        return self.bytes + self.rereads


def op_class(op: Op, graph: Graph | None = None) -> str:
    """The op's cost class (OP_CLASSES); without the graph a MatMul is "gemm"."""
    t = op.op_type
    if op.domain not in ("", "ai.onnx"):
        return "other"
    if t in ("Conv", "ConvTranspose"):
        return _conv_class(op, graph)
    if t in ("Gemm", "MatMul", "MatMulInteger"):
        if graph is None:
            return "gemm"
        if t != "Gemm" and _batched(op, graph):
            return "matmul_batched"
        return "gemm_few_rows" if _output_rows(op, graph) < FEW_ROWS else "gemm"
    if t in SHAPE_OPS:
        return "shape"
    if t == "Transpose":
        return "transpose"     # a strided permutation, slower per byte than the contiguous copies of "data"
    if t in EXP_REDUCTION_OPS:
        return "reduction_exp"
    if t in TRANSCENDENTAL_OPS:
        return "transcendental"
    for cls, ops in (("elementwise", ELEMENTWISE_OPS), ("reduction", REDUCTION_OPS), ("pool", POOL_OPS),
                     ("norm", NORM_OPS), ("softmax", SOFTMAX_OPS), ("gather", GATHER_OPS), ("data", DATA_OPS)):
        if t in ops:
            return cls
    return "other"


def op_cost(op: Op, graph: Graph) -> OpCost:
    """The op's class, FLOPs and bytes moved (see the module docstring for the formulas)."""
    cls = op_class(op, graph)
    ins = [graph.tensors[n] for n in op.present_inputs]
    outs = [graph.tensors[n] for n in op.present_outputs]
    dtype = _arith_dtype(ins, outs)
    if cls == "shape":
        return OpCost(cls, 0, 0, dtype)
    numel_out = max((t.numel for t in outs), default=0)
    numel_in = ins[0].numel if ins else 0
    t = op.op_type
    if t == "Conv":
        w = ins[1].shape
        flops = 2 * outs[0].numel * math.prod(w[1:]) + (outs[0].numel if len(ins) > 2 else 0)
    elif t == "ConvTranspose":
        w = ins[1].shape
        flops = 2 * ins[0].numel * math.prod(w[1:]) + (outs[0].numel if len(ins) > 2 else 0)
    elif t == "Gemm":
        a = ins[0].shape
        k = a[0] if op.attributes.get("transA", 0) else a[1]
        flops = 2 * outs[0].numel * k + (outs[0].numel if len(ins) > 2 else 0)
    elif t in ("MatMul", "MatMulInteger"):
        k = ins[0].shape[-1]
        flops = 2 * outs[0].numel * k
    elif cls in ("elementwise", "transcendental", "other"):
        flops = numel_out
    elif cls in ("reduction", "reduction_exp"):
        flops = numel_in
    elif cls == "pool":
        kernel = op.attributes.get("kernel_shape")
        flops = numel_out * math.prod(kernel) if kernel else numel_in
    elif cls == "norm":
        flops = (2 if t == "BatchNormalization" and len(outs) == 1 else 5) * numel_in
    elif cls == "softmax":
        flops = 4 * numel_in
    else:                   # gather, transpose, data: copies, no arithmetic
        flops = 0
    loops = broadcast_loops([t.shape for t in ins], outs[0].shape) if cls in LOOP_CLASSES and outs else 0
    rereads = (ins[0].shape[0] - 1) * ins[1].nbytes if t in ("Conv", "ConvTranspose") and "wgrad" not in cls else 0
    return OpCost(cls, int(flops), _bytes_moved(op, cls, ins, outs), dtype, loops, rereads)


def _conv_class(op: Op, graph: Graph | None) -> str:
    """conv / conv_transpose, `_grouped` with groups, `_wgrad` with a computed kernel (Conv only),
    `_3d` with three spatial dimensions (group 1 only). Without the graph: kernel static, 2-D."""
    kind = "conv" if op.op_type == "Conv" else "conv_transpose"
    w = graph.tensors.get(op.inputs[1]) if graph is not None and len(op.inputs) > 1 else None
    wgrad = kind == "conv" and w is not None and not w.is_static
    if int(op.attributes.get("group", 1)) != 1:
        return "conv_grouped_wgrad" if wgrad else kind + "_grouped"
    return (kind + ("_wgrad" if wgrad else "")
            + ("_3d" if w is not None and len(w.shape) == 5 else ""))


# A product with fewer output rows than this (a classifier head at a small batch) does too little
# arithmetic per weight byte to hide streaming the weight: ResNet-18's at batch 4 runs at 25 GB/s
# of weight and 50 GFLOP/s, BERT's 32-token layers at 100 GFLOP/s.
FEW_ROWS = 16


def _output_rows(op: Op, graph: Graph) -> int:
    """Rows of a matrix product's result, its batch dimensions folded in."""
    shape = graph.tensors[op.outputs[0]].shape
    return math.prod(shape[:-1]) if shape else 1


def _batched(op: Op, graph: Graph) -> bool:
    """A MatMul of two stacks of matrices (attention's QK^T and PV, their gradients): both
    operands and the result have a batch dimension."""
    shapes = [graph.tensors[n].shape for n in op.present_inputs + op.present_outputs]
    return len(shapes) == 3 and all(len(s) >= 3 for s in shapes)


def broadcast_loops(shapes: list[tuple], out: tuple) -> int:
    """Inner loops ONNX Runtime's CPU broadcaster runs for an elementwise op whose inputs differ
    in shape: the output's element count over the span one loop covers; 0 when no input is
    broadcast. A span is the run of innermost output dimensions (size-1 ones skipped) over which
    every input is either full or broadcast throughout. A scalar operand takes another path:
    its span ends at the first size-1 output dimension from the innermost, so a weight of shape
    (C_out, C_in, 1, 1) times a scalar learning rate runs one loop per element."""
    if len(shapes) < 2 or all(tuple(s) == tuple(out) for s in shapes):
        return 0
    numel = math.prod(out)
    span = 1
    if any(len(s) == 0 for s in shapes):
        for d in reversed(out):
            if d == 1:
                break
            span *= d
        return numel // max(span, 1)
    pattern = None
    for axis in range(1, len(out) + 1):
        d = out[-axis]
        if d == 1:
            continue
        mine = tuple(len(s) >= axis and s[-axis] == d for s in shapes)
        if pattern is not None and mine != pattern:
            break
        pattern = mine
        span *= d
    return numel // max(span, 1)


def _bytes_moved(op: Op, cls: str, ins, outs) -> int:
    out_bytes = sum(t.nbytes for t in outs)
    if op.op_type in ("Gather", "GatherElements", "GatherND"):
        # reads the fetched rows (as many bytes as it writes) and the indices, not the whole table
        return sum(t.nbytes for t in ins[1:]) + 2 * out_bytes
    if op.op_type == "Slice":
        return sum(t.nbytes for t in ins[1:]) + 2 * out_bytes
    return sum(t.nbytes for t in ins) + out_bytes


def _arith_dtype(ins, outs) -> str:
    for t in (*ins, *outs):
        if dtypes.is_float(t.dtype):
            return dtypes.name(t.dtype)
    return dtypes.name(outs[0].dtype) if outs else "float32"


def profile_class(op_class_: str, hw: Hardware) -> str:
    """The class whose figures `hw` prices `op_class_` with: itself, else the nearest class up
    its PARENT_CLASS chain the profile has figures for; itself where none has."""
    cls = op_class_
    while not hw.has_class(cls) and cls in PARENT_CLASS:
        cls = PARENT_CLASS[cls]
    return cls if hw.has_class(cls) else op_class_


def roofline_time(op: Op, graph: Graph, hw: Hardware) -> float:
    """Seconds on `hw`: the fitted line of a calibrated class, else the roofline (module docstring)."""
    c = op_cost(op, graph)
    if c.op_class == "shape":
        return 0.0
    cls = profile_class(c.op_class, hw)
    if cls in hw.op_class_overhead:
        return fitted_time(hw, cls, c.flops, c.fitted_bytes, c.loops, ops=1)
    return max(c.flops / hw.flops_for(cls, c.dtype), c.bytes / hw.bandwidth_for(cls)) + hw.launch_overhead


def fitted_time(hw: Hardware, cls: str, flops: float, nbytes: float, loops: float, ops: float = 1) -> float:
    """A calibrated class's line: ops x overhead + flops / FLOP/s + bytes / bandwidth + loops x
    loop cost, each term the profile has a figure for."""
    t = ops * hw.op_class_overhead[cls]
    if cls in hw.op_class_flops:
        t += flops / hw.op_class_flops[cls]
    if cls in hw.op_class_bandwidth:
        t += nbytes / hw.op_class_bandwidth[cls]
    return t + loops * hw.op_class_loop.get(cls, 0.0)


# ---- measured costs ----------------------------------------------------------------------
@dataclass
class CostTable:
    """Measured seconds per op (by name) and per op signature; `meta` says how it was measured."""

    times: dict[str, float]
    by_signature: dict[str, float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def time(self, op: Op, graph: Graph) -> float:
        return self.priced(op, graph)[0]

    def priced(self, op: Op, graph: Graph) -> tuple[float, str, list[str]]:
        """(seconds, how, sources): how is "name", "signature", "sources" (a rewritten op priced
        from the ops it was made from, named in sources) or "roofline" (added glue, on the
        profile named in sources). Raises UserError for an op no rule prices."""
        if op.name in self.times:
            return self.times[op.name], "name", []
        sig = signature(op, graph)
        if sig in self.by_signature:
            return self.by_signature[sig], "signature", []
        record = _added_by(op.name, graph.metadata)
        if record is None:
            raise UserError(f"the cost table has no time for op '{op.name}' ({op.op_type}); "
                            f"profile this graph with `memsched profile`")
        found = self._from_sources(op, graph, record)
        if found is not None:
            return found
        hw = self.fallback_hardware()
        return roofline_time(op, graph, hw), "roofline", [hw.name]

    def pricing(self, graph: Graph) -> dict:
        """How the table prices `graph`'s ops (JSON-able): counts per way, the rewritten ops
        priced from their sources (op -> sources) and those priced by the roofline (op -> profile)."""
        counts = {"name": 0, "signature": 0, "sources": 0, "roofline": 0}
        from_sources, roofline = {}, {}
        for op in graph.ops:
            _, how, sources = self.priced(op, graph)
            counts[how] += 1
            if how == "sources":
                from_sources[op.name] = sources
            elif how == "roofline":
                roofline[op.name] = sources[0]
        return {"source": "table", "device": self.meta.get("device"), "ops": counts,
                "from_sources": from_sources, "roofline": roofline}

    def fallback_hardware(self) -> Hardware:
        """The profile that prices added glue ops: `cpu` for a table measured on the CPU (where
        this install has it), else the default GPU preset."""
        from . import hardware

        if self.meta.get("device") == "cpu":
            try:
                return hardware.load("cpu")
            except UserError:
                pass
        return hardware.load(hardware.PLANNING_PROFILE)

    def _from_sources(self, op: Op, graph: Graph, record: dict) -> tuple[float, str, list[str]] | None:
        """A rewritten op priced from the ops it was made from (module docstring), or None where
        the table times none of them."""
        removed = {o["name"]: o for o in record.get("ops", []) if isinstance(o, dict) and "name" in o}
        base = _source_name(op.name)
        if base != op.name and base in self.times:
            source = _op_of(removed[base]) if base in removed else graph.op_by_name.get(base)
            share = _work_share(op, graph, source, record) if source is not None else 1.0
            return self.times[base] * share, "sources", [base]
        sources = _replaced_producers(op, removed)
        if sources and all(name in self.times for name in sources) \
                and _same_inputs(op, graph, sources, removed, record):
            return sum(self.times[name] for name in sources), "sources", sources
        return None

    def total(self) -> float:
        return sum(self.times.values())

    def to_dict(self) -> dict:
        return {"format": "memsched-costs", "version": 1, **self.meta, "times": self.times,
                "by_signature": self.by_signature}

    def save(self, path: str | Path) -> Path:
        return write_text_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        path = Path(path)
        data = read_document(path, "cost table")
        if not isinstance(data, dict) or data.get("format") != "memsched-costs":
            raise UserError(f"{path} is not a memsched cost table (write one with `memsched profile`)")
        if data.get("version") != 1:
            raise UserError(f"{path} is a memsched cost table of version {data.get('version')!r}; this memsched "
                            f"reads version 1 (write it again with `memsched profile`)")
        times = _seconds_table(data.get("times", {}), "times", path)
        by_sig = _seconds_table(data.get("by_signature", {}), "by_signature", path)
        meta = {k: v for k, v in data.items() if k not in ("format", "version", "times", "by_signature")}
        return cls(times, by_sig, meta)


COPY_SEGMENT = re.compile(r"/(?:chunk|part)\d+(?=/|$)|/backward(?=/|$)")   # what a part or chunk copy adds


def _added_by(name: str, metadata: dict[str, str]) -> dict | None:
    """The rewrite record (passes.reuse.record_rewrite) in `metadata` whose added ops include `name`."""
    for text in metadata.values():
        record = _rewrite_record(text)
        if record is not None and name in record["added"]:
            return record
    return None


@functools.lru_cache(maxsize=64)
def _rewrite_record(text: str) -> dict | None:
    """A metadata value parsed as a rewrite record ({"added": [...], "ops": [...], ...}), else None."""
    if not text.startswith("{") or '"added"' not in text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("added"), list):
        return None
    return {**record, "added": frozenset(n for n in record["added"] if isinstance(n, str))}


def _source_name(name: str) -> str:
    """The op a part or chunk copy was made from: `X/part0` -> `X`, `X/chunk1/grad/Conv` -> `X/grad/Conv`."""
    return COPY_SEGMENT.sub("", name)


def _replaced_producers(op: Op, removed: dict[str, dict]) -> list[str]:
    """The replaced ops that made `op`'s outputs and, back through their inputs, the replaced ops
    feeding them (a fused update: the update ops and the dW Gemm), in record order."""
    producer = {t: name for name, o in removed.items() for t in o.get("outputs", []) if t}
    found: set[str] = set()
    todo = [producer[t] for t in op.present_outputs if t in producer]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        todo.extend(producer[t] for t in removed[name].get("inputs", []) if t in producer)
    return [name for name in removed if name in found]


def _same_inputs(op: Op, graph: Graph, sources: list[str], removed: dict[str, dict], record: dict) -> bool:
    """Whether the replaced ops `sources` read, from outside themselves, no computed tensor
    that `op` does not read, itself or through a scaling by a scalar the rewrite added: they
    did `op`'s work (a fused update: the Gemm's A and B, the weight and the constants; its A
    read through the lr scaling), not merely lie upstream of it (the Concat before split parts)."""
    made = {t for name in sources for t in removed[name].get("outputs", [])}
    recorded = {t.get("name"): t for t in record.get("tensors", []) if isinstance(t, dict)}
    added = set(record.get("added", []))
    reads = set(op.inputs)          # and through a scaling by a scalar the rewrite added before it (the lr's)
    for u in op.present_inputs:
        scale = graph.producer.get(u)
        if scale is not None and scale.name in added and scale.op_type == "Mul" \
                and any(graph.tensors[t].numel == 1 for t in scale.present_inputs):
            reads.update(scale.inputs)
    for name in sources:
        for t in removed[name].get("inputs", []):
            if not t or t in made or t in reads:
                continue
            static = graph.tensors[t].is_static if t in graph.tensors else recorded.get(t, {}).get("value") is not None
            if not static:
                return False
    return True


def _op_of(o: dict) -> Op:
    """A replaced op from its record entry (attributes as recorded: enough for `op_cost`)."""
    return Op(o["name"], o.get("op_type", ""), list(o.get("inputs", [])), list(o.get("outputs", [])),
              dict(o.get("attributes", {})), o.get("domain", ""))


def _work_share(op: Op, graph: Graph, source: Op, record: dict) -> float:
    """`op`'s work over `source`'s (FLOPs where both compute, else the bytes of their inputs and
    outputs); 1 where unknown.
    The source's tensors are the graph's, or the record's where the rewrite replaced them."""
    tensors = dict(graph.tensors)
    for t in record.get("tensors", []):
        if isinstance(t, dict) and t.get("shape") is not None:
            tensors[t["name"]] = Tensor(t["name"], tuple(t["shape"]), int(t["dtype"]), t.get("kind", "activation"))
    if any(name not in tensors for name in source.present_inputs + source.present_outputs):
        return 1.0
    try:
        mine, theirs = op_cost(op, graph).flops, op_cost(source, _Tensors(tensors)).flops
    except (IndexError, KeyError, TypeError, ValueError):
        return 1.0
    if mine and theirs:
        return mine / theirs
    mine, theirs = (sum(g[t].nbytes for t in o.present_inputs + o.present_outputs)
                    for o, g in ((op, graph.tensors), (source, tensors)))
    return mine / theirs if mine and theirs else 1.0


@dataclass
class _Tensors:
    """What `op_cost` reads of a graph: its tensors."""

    tensors: dict[str, Tensor]


MAX_OP_SECONDS = 3600.0    # an op timed longer than an hour is a broken table, and sums of such overflow


def _seconds_table(value, key: str, path: Path) -> dict[str, float]:
    """A cost table's `key` entry: names to finite, non-negative seconds (no strings, bools or NaN)."""
    if not isinstance(value, dict):
        raise UserError(f"{path}: '{key}' must be a table of op name -> seconds")
    table = {}
    for name, seconds in value.items():
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
                or not 0 <= seconds <= MAX_OP_SECONDS:      # NaN fails both comparisons
            raise UserError(f"{path}: {key}['{name}'] must be seconds from 0 to {MAX_OP_SECONDS:g}, "
                            f"not {seconds!r}")
        table[str(name)] = float(seconds)
    return table


def model_pricing(graph: Graph, hw: Hardware) -> dict:
    """How the cost model prices `graph`'s ops on `hw` without a table (JSON-able, the report's
    `costs`): counts of ops priced by a calibrated class's fitted line, by the spec-sheet roofline,
    and shape ops (free)."""
    counts = {"fitted": 0, "roofline": 0, "shape": 0}
    for op in graph.ops:
        cls = op_class(op, graph)
        if cls == "shape":
            counts["shape"] += 1
        else:
            counts["fitted" if profile_class(cls, hw) in hw.op_class_overhead else "roofline"] += 1
    return {"source": "roofline", "hardware": hw.name, "calibrated": bool(hw.op_class_overhead), "ops": counts}


# graph -> id(hardware) -> (that hardware, op name -> roofline seconds): the passes and the
# simulator price every op of a 10,000-op step dozens of times per compile
_ROOFLINE_TIMES: "weakref.WeakKeyDictionary[Graph, dict[int, tuple[Hardware, dict[str, float]]]]" = \
    weakref.WeakKeyDictionary()


def op_time(op: Op, graph: Graph, source: "Hardware | CostTable") -> float:
    """Seconds `op` takes: measured if `source` is a CostTable, else the roofline on `source`
    (cached per graph and hardware: a graph's ops and shapes do not change once built)."""
    if isinstance(source, CostTable):
        return source.time(op, graph)
    per_graph = _ROOFLINE_TIMES.setdefault(graph, {})
    times = per_graph.setdefault(id(source), (source, {}))[1]
    seconds = times.get(op.name)
    if seconds is None:
        seconds = times[op.name] = roofline_time(op, graph, source)
    return seconds


# ---- signatures --------------------------------------------------------------------------
SMALL_CONSTANT = 64   # elements: constant inputs up to this size (shapes, axes) enter the signature


def signature(op: Op, graph: Graph) -> str:
    """What determines an op's run time: domain, type, attributes, input shapes and dtypes, which
    inputs are constants, and the values of small non-float constants (shapes, axes, pads).
    Same signature, same time."""
    inputs = []
    for name in op.inputs:
        if not name:
            inputs.append(None)
            continue
        t = graph.tensors[name]
        entry = [list(t.shape), int(t.dtype), t.is_static]
        if t.is_static and t.numel <= SMALL_CONSTANT and not dtypes.is_float(t.dtype):
            entry.append(np.asarray(tensor_value(t, graph.base_dir)).ravel().tolist())
        inputs.append(entry)
    attrs = {k: _jsonable(v) for k, v in sorted(op.attributes.items())}
    return json.dumps([op.domain, op.op_type, attrs, inputs], sort_keys=True, separators=(",", ":"))


def _jsonable(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, onnx.TensorProto):
        array = numpy_helper.to_array(value)
        if array.size <= SMALL_CONSTANT:
            return {"dtype": int(value.data_type), "value": array.ravel().tolist(), "dims": list(value.dims)}
        return {"dtype": int(value.data_type), "dims": list(value.dims),
                "sha1": hashlib.sha1(value.SerializeToString()).hexdigest()}
    if isinstance(value, (onnx.GraphProto, onnx.SparseTensorProto, onnx.TypeProto)):
        return {"sha1": hashlib.sha1(value.SerializeToString()).hexdigest()}
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    return value


# ---- fitting the calibrated lines --------------------------------------------------------
FIT_WEIGHT_POWER = 0.25


def fit_class_costs(rows: list[dict], power: float = FIT_WEIGHT_POWER) -> dict[str, dict[str, float]]:
    """Per class, the line `fitted_time` prices it by, fitted to timed rows.

    A row is ops of one class timed together: {"class", "ops", "flops", "bytes", "loops",
    "seconds"}. Per class, non-negative least squares of seconds on ops (the per-op overhead),
    FLOPs (FLOP_CLASSES), bytes and broadcast loops (LOOP_CLASSES), each row's residual weighted
    by seconds ** -power: 0 fits absolute seconds (the long ops decide), 1 relative error (the
    thousands of short ops decide); the default 1/4 keeps a step's total and its short ops both
    close on the bundled models (docs/cost_model.md). Returns
    class -> {"overhead": s, "flops": FLOP/s, "bandwidth": bytes/s, "loop": s}, the rates only
    where their coefficient is positive. Timings made by such lines are recovered exactly."""
    fitted = {}
    for cls in sorted({r["class"] for r in rows}):
        mine = [r for r in rows if r["class"] == cls and r["seconds"] > 0]
        if not mine:
            continue
        terms = ["ops", *(["flops"] if cls in FLOP_CLASSES else []), "bytes",
                 *(["loops"] if cls in LOOP_CLASSES else [])]
        terms = [t for t in terms if any(r.get(t, 0) for r in mine)]
        a = np.array([[float(r.get(t, 0)) for t in terms] for r in mine])
        y = np.array([float(r["seconds"]) for r in mine])
        w = y ** -power
        coef = _nnls(a * w[:, None], y * w)
        line = {"overhead": 0.0}
        for term, c in zip(terms, coef):
            if term == "ops":
                line["overhead"] = float(c)
            elif c > 0:
                line[{"flops": "flops", "bytes": "bandwidth", "loops": "loop"}[term]] = \
                    float(c) if term == "loops" else float(1 / c)
        fitted[cls] = line
    return fitted


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a x - y| over x >= 0, by trying every subset of free columns (there are at most
    four): the best unconstrained fit on a subset whose coefficients are all non-negative."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(y * y))
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)       # columns of seconds per FLOP, per byte...
    a = a / scale
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(x < 0):
            continue
        err = float(np.sum((a[:, cols] @ x - y) ** 2))
        if err < best_err * (1 - 1e-12):
            best, best_err = np.zeros(n), err
            best[cols] = x
    return best / scale
