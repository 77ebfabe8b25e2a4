"""Measured costs with ONNX Runtime: a cost table for a graph, and the calibrated `cpu` profile.

`profile_graph` runs the graph op by op, each op in its own one-node session made as the
executor makes its sessions (`memsched.ort.op_session`: no graph optimisation, every tensor
bound, parameters and constants too, so nothing is prepacked) with its real shapes and its
real input values (each op's outputs feed the next ones; graph inputs are random normal floats
and zero integers). What is timed is the kernel a plan's run executes: timed in ONNX Runtime's
default session instead, with weights as initializers, ResNet-18's small step summed to 0.82
of what the executor takes (the layout transformer's NCHWc convolutions, prepacked weights).
An op is timed with inputs and outputs bound in advance (IOBinding): warm-up runs, then the
median of the timed runs. Ops with the same signature (memsched.cost.signature) share one
session and are timed once; a repeat is run once more only to produce its outputs.

Three corrections make the sum of one-node timings a step's time:
- overheads: a one-node session pays ORT's per-Run overhead, which a node inside a graph does
  not, and the per-node dispatch, which it does. Both are measured first: `session_overhead`
  (one Run of a one-element Add) and `node_overhead` (the slope of Run time over a chain of
  such Adds); an op's time is max(median - session_overhead, 0) + node_overhead.
- caches (CPU): timed run after run, an op finds its inputs in the cache; inside a step,
  parameters read once per step and activations saved for the backward pass come from DRAM.
  `dram_reads` estimates those bytes (LRU reuse distance over the arena's physical buffers);
  the hardware prefetcher streams them while the op computes, so an op takes at least
  node_overhead + those bytes / the measured single-core DRAM read rate: a GEMM reading its
  weights from DRAM stays compute bound, a copy of them becomes memory bound.
- clock: with one intra-op thread (`threads=1`) ORT runs kernels on the calling thread, and
  that thread's CPU time is used: immune to other processes on a shared machine. Otherwise
  wall time.

`calibrate` times microbenchmarks of every op class and every op of reference training steps
the same way, and fits each op class's line (memsched.cost.fit_class_costs: per-op overhead,
FLOP/s, bandwidth, broadcast loop cost, by least squares); the node overhead is the launch
overhead of classes without a line, and a memcpy the "link" (on a CPU, swapping is a copy within
DRAM). `memsched hardware calibrate -o FILE --threads 1` writes it; the bundled `cpu` preset
(memsched/profiles/cpu.json) was made that way on the dev machine (docs/cost_model.md).
"""
from __future__ import annotations

import bisect
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import frontend
from .cost import FLOP_CLASSES, CostTable, fit_class_costs, op_class, op_cost, signature
from .errors import UserError
from .hardware import DRAM_LATENCY, Hardware, HostTier, optane_pmem
from .ir import Graph, Op, tensor_value
from .memory import analyze
from .onnx_utils import make_model
from .ort import PROVIDERS, bind_values, op_session
from .ort import version as ort_version
from .schedule import default_schedule
from .units import format_bytes

MIN_TIMED_SECONDS = 0.02     # keep timing a fast op until this much time is covered ...
MAX_RUNS = 200               # ... or this many runs


@dataclass
class Timer:
    """A session with its inputs and outputs bound, ready to be run repeatedly."""

    session: object
    binding: object
    device: str
    clock: object = time.perf_counter

    @classmethod
    def bind(cls, session, feeds: dict[str, np.ndarray], outputs: list[tuple[str, tuple, np.dtype]],
             device: str, threads: int = 0) -> "Timer":
        return cls(session, bind_values(session, device, feeds, outputs), device, cpu_clock(device, threads))

    def run(self) -> float:
        start = self.clock()
        self.session.run_with_iobinding(self.binding)
        if self.device == "cuda":
            self.binding.synchronize_outputs()
        return self.clock() - start

    def median(self, repeats: int, warmup: int = 2) -> float:
        """Median of `repeats` runs, more for fast ops (until MIN_TIMED_SECONDS or MAX_RUNS)."""
        for _ in range(warmup):
            self.run()
        samples: list[float] = []
        while len(samples) < repeats or (sum(samples) < MIN_TIMED_SECONDS and len(samples) < MAX_RUNS):
            samples.append(self.run())
        return statistics.median(samples)

    def outputs(self) -> list[np.ndarray]:
        return [v.numpy() for v in self.binding.get_outputs()]


def cpu_clock(device: str, threads: int):
    """The clock to time with. With one intra-op thread ONNX Runtime runs kernels on the calling
    thread, so that thread's CPU time is the run's time, untouched by other processes sharing
    the machine; otherwise wall time."""
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter


def last_level_cache() -> int:
    """Bytes of the largest CPU cache (Linux sysfs); 32 MiB if it cannot be read."""
    sizes = []
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(base)):
            with open(os.path.join(base, index, "size")) as f:
                text = f.read().strip()
            unit = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KM")) * unit)
    except (OSError, ValueError):
        pass
    return max(sizes) if sizes else 32 * 2**20


def dram_reads(graph: Graph, cache_bytes: int) -> dict[str, int]:
    """Bytes each op reads from DRAM inside a step but found in cache when timed alone.

    Timed alone, run after run, an op finds its inputs cached if its working set (inputs and
    outputs) fits. Inside the step an input is cached only if its buffer and the distinct
    buffers touched since its last touch fit: LRU stack distance in bytes over physical
    buffers (`_arena_buffers`: freed storage is reused, as ONNX Runtime's arena does), in the
    graph's stored order, over a second step so parameters were last touched in the previous
    one; graph inputs were just written by the input pipeline."""
    buffer, size = _arena_buffers(graph)
    touches = 2 * sum(len({*op.present_inputs, *op.present_outputs}) for op in graph.ops) + len(graph.inputs)
    tree = [0] * (touches + 1)           # Fenwick tree: bytes of each buffer at its latest touch

    def add(i: int, v: int) -> None:
        while i <= touches:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:
        total = 0
        while i > 0:
            total += tree[i]
            i -= i & -i
        return total

    last: dict[int, int] = {}
    clock = 0

    def touch(b: int) -> None:
        nonlocal clock
        clock += 1
        if b in last:
            add(last[b], -size[b])
        last[b] = clock
        add(clock, size[b])

    reads: dict[str, int] = {}
    for measured in (False, True):
        if measured:
            for t in graph.inputs:
                touch(buffer[t])
        for op in graph.ops:
            if op_class(op) == "shape":            # views and shape queries read no data
                reads[op.name] = 0
                continue
            inputs, outputs = list(dict.fromkeys(op.present_inputs)), op.present_outputs
            if measured:
                fits_alone = sum(graph.tensors[t].nbytes for t in inputs + outputs) <= cache_bytes
                reads[op.name] = sum(graph.tensors[t].nbytes for t in inputs if fits_alone and buffer[t] in last
                                     and prefix(clock) - prefix(last[buffer[t]]) + size[buffer[t]] > cache_bytes)
            for t in inputs + outputs:
                touch(buffer[t])
    return reads


def _arena_buffers(graph: Graph) -> tuple[dict[str, int], list[int]]:
    """tensor -> the physical buffer it occupies in the default schedule, best-fit reuse of freed
    buffers (lifetimes from the memory model); and each buffer's bytes."""
    profile = analyze(graph, default_schedule(graph))
    starts: dict[int, list] = {}
    for r in profile.residencies:
        starts.setdefault(r.start, []).append(r)
    size: list[int] = []
    free: list[tuple[int, int]] = []          # (bytes, buffer id), sorted
    ends: dict[int, list[int]] = {}
    buffer: dict[str, int] = {}
    for step in range(len(graph.ops)):
        for r in sorted(starts.get(step, []), key=lambda r: -r.nbytes):
            i = bisect.bisect_left(free, (r.nbytes, -1))
            if i < len(free):
                b = free.pop(i)[1]
            else:
                b = len(size)
                size.append(r.nbytes)
            buffer[r.tensor] = b
            ends.setdefault(r.end, []).append(b)
        for b in ends.pop(step, []):
            bisect.insort(free, (size[b], b))
    return buffer, size


def dram_read_rate(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s one core reads from DRAM (a sum over an array far larger than any cache)."""
    data = np.ones(nbytes // 4, np.float32)
    data.sum()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        data.sum()
        times.append(time.thread_time() - start)
    return nbytes / min(times)


# ---- the overheads of a one-node session -------------------------------------------------
def _add_chain(length: int) -> onnx.ModelProto:
    vi = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, [1])  # noqa: E731
    nodes = [helper.make_node("Add", [f"v{i}", "c"], [f"v{i + 1}"]) for i in range(length)]
    return make_model(helper.make_graph(nodes, "chain", [vi("v0"), vi("c")], [vi(f"v{length}")]))


def overheads(device: str = "cpu", threads: int = 0, repeats: int = 200) -> tuple[float, float]:
    """(session_overhead, node_overhead) in seconds: one Run of a one-Add session, and the cost
    of one more node in a session (slope over a chain of 1 and 33 Adds)."""
    one = np.ones(1, np.float32)
    times = []
    for length in (1, 33):
        timer = Timer.bind(op_session(_add_chain(length), device, threads), {"v0": one, "c": one},
                           [(f"v{length}", (1,), np.float32)], device, threads)
        times.append(timer.median(repeats, warmup=20))
    return times[0], max(times[1] - times[0], 0.0) / 32


# ---- one op as a model -------------------------------------------------------------------
def single_op_model(op: Op, graph: Graph) -> tuple[onnx.ModelProto, list[str]]:
    """A one-node model computing `op`, every input a model input, as in the executor's
    sessions (parameters and constants are bound arena bytes there, not initializers, so ONNX
    Runtime prepacks none of them).

    Returns the model and, per model input in order, the tensor it is fed. Model inputs are
    named by position (`FEED_PREFIX<k>`), one per input slot even where a tensor fills two
    (x * x): every op with the same signature then has the same inputs, so their shared
    session can be fed any of them."""
    if op.domain not in ("", "ai.onnx"):
        raise UserError(f"op '{op.name}' is in domain '{op.domain}', which ONNX Runtime cannot time")
    inputs, infos = [], []
    for k, name in enumerate(op.inputs):
        if name:
            inputs.append(f"{FEED_PREFIX}{k}")
            infos.append(_value_info(graph, name, inputs[-1]))
        else:
            inputs.append(name)
    node = helper.make_node(op.op_type, inputs, op.outputs, name=op.name, domain=op.domain or None)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in op.attributes.items())
    g = helper.make_graph([node], op.name, infos, [_value_info(graph, n, n) for n in op.present_outputs])
    opset = graph.opset_imports.get("", graph.opset_imports.get("ai.onnx", 17))
    return make_model(g, opset=opset, ir_version=graph.ir_version), _feeds_of(op)


FEED_PREFIX = "memsched.input."


def _value_info(graph: Graph, tensor: str, name: str) -> onnx.ValueInfoProto:
    t = graph.tensors[tensor]
    return helper.make_tensor_value_info(name, t.dtype, list(t.shape))


def prepare_inputs(graph: Graph, given: dict[str, np.ndarray] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """The graph's inputs: `given` ones checked against their declared types, the rest made up.

    Made-up values are reproducible: floats from a seeded normal, integers and booleans zero
    (a valid class label, token id or index for any graph)."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(graph.inputs))
    if unknown:
        raise UserError(f"the graph has no input named '{unknown[0]}' (inputs: {', '.join(graph.inputs)})")
    require_host_memory(sum(graph.tensors[name].nbytes for name in graph.inputs), "the step's input data")
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in graph.inputs:
        t = graph.tensors[name]
        dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
        if name in given:
            value = np.asarray(given[name])
            if value.shape != t.shape or value.dtype != dtype:
                raise UserError(f"input '{name}' must be {dtype} of shape {t.shape}, not {value.dtype} "
                                f"of shape {value.shape}")
            feeds[name] = np.ascontiguousarray(value)
        elif np.issubdtype(dtype, np.floating):
            feeds[name] = rng.standard_normal(t.shape).astype(dtype)
        else:
            feeds[name] = np.zeros(t.shape, dtype)
    return feeds


def feed_values(graph: Graph, inputs: list[str], feeds: list[str], values: dict[str, np.ndarray]) -> dict:
    """{model input: value} for a one-node model's `inputs`, fed `feeds`: computed values from
    `values`, parameters and constants decoded from the graph (on demand, never kept)."""
    return {s: values[t] if t in values else tensor_value(graph.tensors[t], graph.base_dir)
            for s, t in zip(inputs, feeds)}


def np_dtype(graph: Graph, name: str) -> np.dtype:
    return helper.tensor_dtype_to_np_dtype(graph.tensors[name].dtype)


def profile_graph(graph: Graph, device: str = "cpu", repeats: int = 10, threads: int = 0, seed: int = 0,
                  progress=None) -> CostTable:
    """Time every op of `graph` with ONNX Runtime (see the module docstring)."""
    if repeats < 1:
        raise UserError("--repeats must be at least 1")
    session_overhead, node_overhead = overheads(device, threads)
    if device == "cpu":
        cache, dram_bw = last_level_cache(), dram_read_rate()
        dram = dram_reads(graph, cache)
    else:                                   # GPU caches are small next to HBM bandwidth: not modelled
        cache, dram_bw, dram = 0, 0.0, {}
    values = prepare_inputs(graph, seed=seed)
    last_use = {}
    for i, op in enumerate(graph.ops):
        for name in op.present_inputs:
            last_use[name] = i
    sessions: dict[str, tuple[Timer, float]] = {}
    times: dict[str, float] = {}
    by_signature: dict[str, float] = {}
    for i, op in enumerate(graph.ops):
        sig = signature(op, graph)
        outputs = [(n, graph.tensors[n].shape, np_dtype(graph, n)) for n in op.present_outputs]
        if sig not in sessions:
            model, feeds = single_op_model(op, graph)
            session = op_session(model, device, threads)
            inputs = [i.name for i in model.graph.input]
            timer = Timer.bind(session, feed_values(graph, inputs, feeds, values), outputs, device, threads)
            raw = timer.median(repeats)
            sessions[sig] = (timer, max(raw - session_overhead, 0.0) + node_overhead)
            by_signature[sig] = sessions[sig][1]
        else:       # same signature: reuse the session (its input/output names are the first op's)
            timer = sessions[sig][0]
            inputs = [i.name for i in timer.session.get_inputs()]
            names = [o.name for o in timer.session.get_outputs()]
            timer = Timer.bind(timer.session, feed_values(graph, inputs, _feeds_of(op), values),
                               [(s, shape, dtype) for s, (_, shape, dtype) in zip(names, outputs)], device,
                               threads)
            timer.run()
        times[op.name] = max(sessions[sig][1], node_overhead + dram.get(op.name, 0) / dram_bw) if dram_bw \
            else sessions[sig][1]
        for (name, _, _), value in zip(outputs, timer.outputs()):
            values[name] = value
        for name in op.present_inputs:
            if last_use.get(name) == i and name not in graph.outputs:
                values.pop(name, None)
        if progress is not None:
            progress(i + 1, len(graph.ops), op)
    meta = {"graph": graph.name, "device": device, "provider": PROVIDERS[device], "repeats": repeats,
            "threads": threads, "onnxruntime": ort_version(), "session_overhead_s": session_overhead,
            "node_overhead_s": node_overhead, "timed_ops": len(sessions), "ops": len(graph.ops),
            "cache_bytes": cache, "dram_read_bw": dram_bw, "dram_read_bytes": sum(dram.values()),
            "clock": cpu_clock(device, threads).__name__}
    return CostTable(times, by_signature, meta)


def _feeds_of(op: Op) -> list[str]:
    """The tensors that fill `op`'s input slots, in order (a tensor in two slots twice)."""
    return [n for n in op.inputs if n]


# ---- calibration -------------------------------------------------------------------------
def _bench_model(op_type: str, shapes: list[tuple], attrs: dict | None = None, weights: dict | None = None,
                 const: dict | None = None) -> Graph:
    """A one-node float32 model; `weights` (name -> shape) become random initializers and `const`
    (name -> int64 array) constant inputs. Inputs named x0, x1, ... in order of `shapes`."""
    rng = np.random.default_rng(0)
    names = [f"x{i}" for i in range(len(shapes))]
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.1, n)
             for n, s in (weights or {}).items()]
    inits += [numpy_helper.from_array(np.asarray(v, np.int64), n) for n, v in (const or {}).items()]
    inputs = names + list(weights or {}) + list(const or {})
    node = helper.make_node(op_type, inputs, ["y"], name=op_type, **(attrs or {}))
    vis = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in zip(names, shapes)]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    return frontend.lower(make_model(helper.make_graph([node], op_type, vis, [out], inits)))


def _benchmarks() -> list[Graph]:
    """Microbenchmarks per op class, at the sizes of small CNN / transformer training steps."""
    b = _bench_model
    conv = lambda x, w, **a: b("Conv", [x], dict(a), {"w": w})  # noqa: E731
    big = (4, 64, 56, 56)
    return [
        b("MatMul", [(256, 512)], weights={"w": (512, 512)}),
        b("MatMul", [(1024, 1024)], weights={"w": (1024, 1024)}),
        b("MatMul", [(512, 3072)], weights={"w": (3072, 768)}),
        b("MatMul", [(8, 12, 128, 64), (8, 12, 64, 128)]),
        b("Gemm", [(64, 2048)], dict(transB=1), weights={"w": (1000, 2048)}),
        conv((4, 64, 56, 56), (64, 64, 3, 3), pads=[1, 1, 1, 1]),
        conv((4, 128, 28, 28), (128, 128, 3, 3), pads=[1, 1, 1, 1]),
        conv((4, 256, 56, 56), (64, 256, 1, 1)),
        conv((4, 256, 14, 14), (256, 256, 3, 3), pads=[1, 1, 1, 1]),
        conv((2, 3, 224, 224), (64, 3, 7, 7), pads=[3, 3, 3, 3], strides=[2, 2]),
        conv((4, 96, 56, 56), (96, 1, 3, 3), pads=[1, 1, 1, 1], group=96),
        conv((4, 384, 14, 14), (384, 1, 3, 3), pads=[1, 1, 1, 1], group=384),
        b("Add", [big, big]),
        b("Mul", [big, (1, 64, 1, 1)]),
        b("Relu", [big]),
        b("Tanh", [big]),
        b("Erf", [big]),
        b("Sigmoid", [big]),
        b("ReduceSum", [big], const={"axes": [0, 2, 3]}),
        b("ReduceMean", [(1024, 768)], dict(axes=[-1])),
        b("MaxPool", [(4, 64, 112, 112)], dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
        b("GlobalAveragePool", [(8, 512, 7, 7)]),
        b("BatchNormalization", [big], weights={"s": (64,), "bias": (64,), "m": (64,), "v": (64,)}),
        b("LayerNormalization", [(1024, 768)], dict(axis=-1), weights={"s": (768,), "bias": (768,)}),
        b("Softmax", [(96, 128, 128)], dict(axis=-1)),
        b("Softmax", [(64, 1000)], dict(axis=-1)),
        b("Transpose", [big], dict(perm=[0, 2, 3, 1])),
        b("Concat", [(4, 64, 28, 28), (4, 64, 28, 28)], dict(axis=1)),
        b("Gather", [], weights={"table": (8192, 768)}, const={"idx": np.arange(1024).reshape(8, 128) * 7}),
    ]


def calibrate(device: str = "cpu", repeats: int = 20, threads: int = 0,
              references: Sequence[Graph] = ()) -> tuple[Hardware, list[dict]]:
    """Fit the cost model's per-class lines for this machine; returns the profile and the rows
    it was fitted to.

    Rows are timed as `profile_graph` times ops: the microbenchmarks (one row each) and every
    op of the reference graphs (real training steps), ops of one graph with the same class and
    work (FLOPs, bytes, broadcast loops) summed into one row. `memsched.cost.fit_class_costs`
    fits each class's overhead and rates to them (least squares)."""
    if device != "cpu":
        raise UserError("only the cpu profile is calibrated here; GPU profiles come from spec sheets")
    session_overhead, node_overhead = overheads(device, threads)
    rows = []
    for g in _benchmarks():
        op = g.ops[0]
        model, feeds = single_op_model(op, g)
        values = prepare_inputs(g)
        outputs = [(n, g.tensors[n].shape, np_dtype(g, n)) for n in op.present_outputs]
        inputs = [i.name for i in model.graph.input]
        timer = Timer.bind(op_session(model, device, threads), feed_values(g, inputs, feeds, values), outputs,
                           device, threads)
        seconds = max(timer.median(repeats) - session_overhead, 0.0) + node_overhead
        c = op_cost(op, g)
        rows.append({"source": "microbenchmark", "op": op.op_type, "class": c.op_class, "ops": 1,
                     "flops": c.flops, "bytes": c.fitted_bytes, "loops": c.loops, "seconds": seconds,
                     "shapes": [list(g.tensors[n].shape) for n in op.present_inputs]})
    for g in references:
        rows.extend(graph_rows(g, profile_graph(g, device, repeats, threads)))
    hw = profile_from_fit(fit_class_costs(rows), rows, node_overhead, threads,
                          ", ".join(g.name for g in references) or "none")
    return hw, rows


def graph_rows(graph: Graph, table: CostTable) -> list[dict]:
    """The timed ops of `graph` as calibration rows: ops of one class, type and work summed."""
    rows: dict[tuple, dict] = {}
    for op in graph.ops:
        c = op_cost(op, graph)
        if c.op_class == "shape":
            continue
        row = rows.setdefault((c.op_class, op.op_type, c.flops, c.fitted_bytes, c.loops), {
            "source": graph.name, "op": op.op_type, "class": c.op_class, "ops": 0, "flops": 0, "bytes": 0,
            "loops": 0, "seconds": 0.0})
        row["ops"] += 1
        row["flops"] += c.flops
        row["bytes"] += c.fitted_bytes
        row["loops"] += c.loops
        row["seconds"] += table.times[op.name]
    return list(rows.values())


def profile_from_fit(fit: dict[str, dict[str, float]], rows: list[dict], node_overhead: float, threads: int,
                     references: str) -> Hardware:
    """The `cpu` profile: the fitted lines per class, the measured node overhead for classes
    without one, and this machine's memory, DRAM copy rate (the swap 'link') and name."""
    peak = max(r["flops"] / r["seconds"] for r in rows if r["class"] in FLOP_CLASSES and r["seconds"] > 0)
    copy_bw, copy_latency = memcpy_rate()
    memory = _physical_memory()
    return Hardware(
        name="cpu", device_memory=memory, peak_flops={"float32": peak},
        memory_bandwidth=fit.get("elementwise", {}).get("bandwidth", copy_bw), launch_overhead=node_overhead,
        link_h2d=copy_bw, link_d2h=copy_bw, link_latency=copy_latency,
        tiers={"dram": HostTier(memory, copy_bw, copy_bw, DRAM_LATENCY), "nvdimm": optane_pmem()},
        description=(f"{_cpu_name()}, {os.cpu_count()} cores, ONNX Runtime {ort_version()} "
                     f"({threads or 'default'} intra-op threads); calibrated {time.strftime('%Y-%m-%d')} by "
                     f"`memsched hardware calibrate` on microbenchmarks and the training steps of {references}; "
                     f"swaps are DRAM copies; nvdimm: Optane figures"),
        **fit_figures(fit))


def fit_figures(fit: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """`fit_class_costs`'s lines as a Hardware's per-class fields."""
    return {"op_class_flops": {k: v["flops"] for k, v in fit.items() if "flops" in v},
            "op_class_bandwidth": {k: v["bandwidth"] for k, v in fit.items() if "bandwidth" in v},
            "op_class_overhead": {k: v["overhead"] for k, v in fit.items()},
            "op_class_loop": {k: v["loop"] for k, v in fit.items() if "loop" in v}}


def memcpy_rate(nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s of a large DRAM copy, seconds of a tiny one): the CPU 'link'."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    big = []
    for _ in range(repeats):           # single-threaded copies: CPU time is immune to other load
        start = time.thread_time()
        np.copyto(dst, src)
        big.append(time.thread_time() - start)
    small_src, small_dst = np.ones(8, np.uint8), np.empty(8, np.uint8)
    small = []
    for _ in range(200):
        start = time.thread_time()
        np.copyto(small_dst, small_src)
        small.append(time.thread_time() - start)
    return nbytes / statistics.median(big), statistics.median(small)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        raise UserError("cannot read this machine's memory size") from None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---- the process's real memory ---------------------------------------------------------------
def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim).

    Why: a freed block stays resident and is reused without growing RSS. Large blocks are
    mapped and unmapped one by one at first, but glibc raises its mapping threshold to the
    size of each one freed, so later blocks of that size come from the heap and stay there
    once freed: a model's weights, each read through a transient copy, would leave as much
    resident again. Elsewhere than glibc nothing happens."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc: nothing to release this way
        pass


def host_memory_bytes() -> int | None:
    """This host's physical memory (sysconf), or None where it cannot be read."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def require_host_memory(nbytes: int, what: str) -> None:
    """A UserError before `what` allocates `nbytes` that this host's memory cannot hold (the
    allocator's own answer would be a MemoryError, or a process the kernel kills)."""
    total = host_memory_bytes()
    if total is not None and nbytes > total:
        raise UserError(f"{what} needs {format_bytes(nbytes)} ({nbytes:,} B); this host has "
                        f"{format_bytes(total)} of memory")


class ProcessMemory:
    """The process's resident memory over a stretch of work, as the OS counts it: RSS when the
    stretch starts and the peak RSS reached until `peak` is read (Linux: VmRSS and VmHWM of
    /proc/self/status, the peak first reset to the current RSS through /proc/self/clear_refs, so
    an earlier, higher peak of the process does not count). Elsewhere, or where the peak
    cannot be reset, `available` is False and every figure is None.

    Growth (peak - start) is what the work added: memory it allocated and touched, freed or not.
    Part of it is file-backed (`file_growth`): mostly shared libraries' code paged in as the
    work runs their functions for the first time, which any process running them pays."""

    STATUS = "/proc/self/status"
    CLEAR_REFS = "/proc/self/clear_refs"

    def __init__(self):
        self.available = self._reset_peak() and self._status("VmRSS") is not None
        self.start = self._status("VmRSS") if self.available else None
        self.file_start = self._status("RssFile") if self.available else None

    @classmethod
    def _reset_peak(cls) -> bool:
        try:
            with open(cls.CLEAR_REFS, "w") as f:
                f.write("5")           # 5: reset the peak resident set size to the current one
            return True
        except OSError:
            return False

    @classmethod
    def _status(cls, field: str) -> int | None:
        """One `kB` field of /proc/self/status, in bytes."""
        try:
            with open(cls.STATUS) as f:
                for line in f:
                    if line.startswith(field + ":"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    def current(self) -> int | None:
        return self._status("VmRSS") if self.available else None

    def peak(self) -> int | None:
        return self._status("VmHWM") if self.available else None

    def growth(self) -> int | None:
        """Peak RSS since the start less RSS at the start, in bytes."""
        peak = self.peak()
        return None if peak is None or self.start is None else max(peak - self.start, 0)

    def file_growth(self) -> int | None:
        """Resident file-backed pages (RssFile) now less at the start, in bytes; None where the
        kernel does not report them."""
        now = self._status("RssFile") if self.file_start is not None else None
        return None if now is None else now - self.file_start
