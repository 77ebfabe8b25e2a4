"""The bundled executor: run a Plan on ONNX Runtime exactly as scheduled, in one arena.

Why its own executor: a plan's memory figures are only believable when a real run keeps
to them. Every op runs in its own ONNX Runtime session (sessions are shared between ops of
the same type, attributes and tensor types) through IOBinding: its inputs are read from,
and its outputs written straight into, their planned offsets in one preallocated arena
(a numpy buffer on CPU, one device allocation on CUDA). Parameters, buffers, constants and
optimizer state live in the arena too. Swap-outs copy bytes to a host tier's store (DRAM:
host buffers, pinned on CUDA; NVDIMM: a memory-mapped file) and swap-ins copy them back;
recomputations re-run the op; frees release the slot.

Before anything runs the plan is judged (memory.validate: residency, budget, placement),
then rehearsed: the executor walks the byte ranges it is about to bind, keeping its own
table of live slots. A read of a range that does not hold the tensor, or a write over a
live slot, is a ScheduleError naming the tensor; the live bytes of that table are the
measured figures, and they must equal the memory model's at every step.

`check=True` also runs the unscheduled graph in one plain ONNX Runtime session (same
options: no graph optimisations, same thread count, every initializer fed as an input so
no kernel sees a constant the per-op sessions do not) and compares every output of every
step; on CPU they must be bit-identical. Released slots are filled with NaN bytes during a
checked run, so a plan that read freed memory could not pass by luck.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper

from .errors import ScheduleError, UserError
from .ir import Graph, Op, _make_node, tensor_value
from .memory import MemoryProfile, Residency, buffer_groups, buffer_roots, check_placement, validate
from .onnx_utils import MEMSCHED_DOMAIN
from .schedule import Plan

DEVICES = ("cpu", "cuda")
POISON = 0xFF        # every float made of these bytes is a NaN
ALIGN = 64           # the arena's base address alignment
# Ops that draw random numbers: never shared between nodes, never recomputed.
RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


@dataclass
class RunResult:
    """What a run measured. Byte figures come from the executor's own slot table."""

    requested_device: str
    provider: str                   # what really ran: the provider ORT assigned the ops' nodes to
    providers: dict[str, int]       # provider -> number of op runs per step it ran
    fallback: str | None            # why a CUDA request ran on CPU, if it did
    steps: int
    arena_bytes: int                # bytes of the arena allocation
    arena_high_water: int           # highest byte any binding touched
    peak_bytes: int                 # measured peak of live bytes
    live_bytes: np.ndarray          # measured live bytes per schedule step
    planned_arena_bytes: int
    planned_peak_bytes: int
    step_times: list[float]
    outputs: dict[str, np.ndarray]  # the last step's outputs
    sessions: int                   # distinct ONNX Runtime sessions built
    ops: int                        # op runs per step (computes and recomputes)
    swapped_bytes: dict[str, int]   # tier -> bytes copied out per step
    check: dict | None = None       # max_abs_diff, passed, exact, per_output, steps

    @property
    def step_time_s(self) -> float:
        return float(np.median(self.step_times))


def run_plan(plan: Plan, steps: int = 1, device: str = "cpu", check: bool = False,
             inputs: dict[str, np.ndarray] | None = None, nvdimm_dir: str | None = None,
             progress: Callable[[int, int], None] | None = None, threads: int = 1,
             given: Graph | None = None, allow_fallback: bool = True) -> RunResult:
    """Run `steps` training steps of `plan`; with `check`, compare against a plain ORT run.

    Multi-step runs feed each `<tensor>.updated` output back as `<tensor>` for the next step.
    `progress(done, total)` is called after each step. `given`: the graph as the user gave
    it, where the plan's differs from it by rewrites that change rounding only (fused
    updates); with `check`, the step is also compared to a plain run of it, within
    CUDA_TOLERANCE (`check["given"]`). Without `allow_fallback`, a CUDA request that CUDA here
    cannot serve is a UserError instead of a run on the CPU."""
    if steps < 1:
        raise UserError(f"--steps must be at least 1, not {steps}")
    if device not in DEVICES:
        raise UserError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
    if threads < 1:
        raise UserError(f"threads must be at least 1, not {threads}")
    profile = validate(plan)
    if plan.offsets is None:
        raise UserError("the plan has no arena offsets; place it first (the placement pass of "
                        "`memsched compile` assigns them)")
    planned_arena = check_placement(profile, plan.offsets)
    graph = plan.graph
    feeds = prepare_inputs(graph, inputs)
    statics = _statics(graph)
    actual_device, fallback = _resolve_device(device)
    if fallback is not None and not allow_fallback:
        raise UserError(f"cannot run on {device}: {fallback}; pass --allow-fallback to run on the CPU instead")

    with _Runtime(actual_device, planned_arena, threads, nvdimm_dir) as rt:
        program = _compile(plan, profile, rt)
        live, high_water = _rehearse(program, profile)
        reference = _Reference(graph, actual_device, threads) if check else None
        ref_statics = dict(statics)
        as_given = _Reference(given, actual_device, threads) if check and given is not None else None
        given_statics = _statics(given) if as_given is not None else {}
        times, diffs, given_diffs = [], [], []
        outputs: dict[str, np.ndarray] = {}
        for k in range(steps):
            _load(program, rt, feeds, statics, poison=check)
            start = time.perf_counter()
            _execute(program, rt, poison=check)
            rt.synchronize()
            times.append(time.perf_counter() - start)
            outputs = _collect(program, rt)
            if reference is not None:
                expected = reference.run(feeds, ref_statics)
                diffs.append(compare_outputs(outputs, expected))
                ref_statics = feed_back(graph, ref_statics, expected)
            if as_given is not None:
                expected = as_given.run(feeds, given_statics)
                given_diffs.append(compare_outputs(outputs, expected))
                given_statics = feed_back(given, given_statics, expected)
            statics = feed_back(graph, statics, outputs)
            if progress is not None:
                progress(k + 1, steps)
        providers = Counter(a.provider for a in program.actions if isinstance(a, _Run))
        sessions, allocated = len(rt.sessions), rt.allocated_bytes()
    return RunResult(
        requested_device=device, provider=_provider_name(providers), providers=dict(providers),
        fallback=fallback, steps=steps, arena_bytes=allocated, arena_high_water=high_water,
        peak_bytes=int(live.max()) if len(live) else 0, live_bytes=live,
        planned_arena_bytes=planned_arena, planned_peak_bytes=profile.peak_bytes, step_times=times,
        outputs=outputs, sessions=sessions, ops=sum(isinstance(a, _Run) for a in program.actions),
        swapped_bytes=dict(program.swapped_bytes),
        check=({**_check_summary(diffs, exact=actual_device == "cpu"),
                "given": _check_summary(given_diffs, exact=False) if as_given is not None else None}
               if check else None))


# ---- inputs and outputs ------------------------------------------------------------------
def _statics(graph: Graph) -> dict[str, np.ndarray]:
    """Every initializer's value: what a step reads besides its inputs."""
    return {t.name: tensor_value(t, graph.base_dir) for t in graph.initializers()}


def prepare_inputs(graph: Graph, given: dict[str, np.ndarray] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """The graph's inputs: `given` ones checked against their declared types, the rest made up.

    Made-up values are reproducible: floats from a seeded normal, integers and booleans zero
    (a valid class label, token id or index for any graph)."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(graph.inputs))
    if unknown:
        raise UserError(f"the graph has no input named '{unknown[0]}' (inputs: {', '.join(graph.inputs)})")
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


def feed_back(graph: Graph, statics: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Next step's initializer values: each `<name>.updated` output replaces `<name>`."""
    result = dict(statics)
    for name in statics:
        updated = outputs.get(f"{name}.updated")
        if updated is not None and updated.shape == statics[name].shape and updated.dtype == statics[name].dtype:
            result[name] = updated
    return result


def compare_outputs(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> dict[str, dict]:
    """Per output: max |actual - expected| and whether the two are bit-identical."""
    result = {}
    for name, want in expected.items():
        got = actual[name]
        same_bits = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
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
        result[name] = {"max_abs_diff": diff, "bit_identical": same_bits}
    return result


def _check_summary(per_step: list[dict[str, dict]], exact: bool) -> dict:
    """Pass on CPU only when bit-identical; on CUDA within a small relative tolerance."""
    worst: dict[str, float] = {}
    identical = True
    for step in per_step:
        for name, d in step.items():
            worst[name] = max(worst.get(name, 0.0), d["max_abs_diff"])
            identical &= d["bit_identical"]
    max_diff = max(worst.values(), default=0.0)
    passed = identical if exact else max_diff <= CUDA_TOLERANCE
    return {"max_abs_diff": max_diff, "passed": bool(passed), "bit_identical": bool(identical),
            "exact": exact, "tolerance": 0.0 if exact else CUDA_TOLERANCE, "steps": len(per_step),
            "per_output": worst}


# cuDNN/cuBLAS may pick different kernels in two sessions; CUDA results are compared to this.
CUDA_TOLERANCE = 1e-4


# ---- the program: what each schedule step binds --------------------------------------------
@dataclass
class _Run:
    op: Op
    session: object
    binding: object
    reads: list[tuple[str, int, int]]                        # tensor, lo, hi
    writes: list[tuple[tuple[str, int], int, int, tuple | None]]  # key, lo, hi, key it shares
    waits: list[int] = field(default_factory=list)
    provider: str = ""   # the execution provider ONNX Runtime assigned the op's node to


@dataclass
class _Copy:
    kind: str           # swap_out or swap_in
    key: tuple[str, int]
    lo: int
    hi: int
    tier: str
    store: np.ndarray   # uint8 view of the tensor's place in the tier's store
    event: int          # index of this copy's completion event
    waits: list[int] = field(default_factory=list)


@dataclass
class _Program:
    actions: list          # one per schedule step; None for a free
    releases: list         # per step: [(key, lo, hi, kept: another residency still holds the bytes)]
    initial: list          # [(key, lo, hi)] loaded before step 0 (inputs, device-resident statics)
    host_initial: dict     # static tensor -> store view it starts in (plan.on_host)
    finals: dict           # output -> ('arena', lo, hi) | ('store', view)
    types: dict            # tensor -> (numpy dtype, shape)
    swapped_bytes: Counter
    events: int


def _compile(plan: Plan, profile: MemoryProfile, rt: "_Runtime") -> _Program:
    graph, schedule = plan.graph, plan.schedule
    n = len(schedule)
    by_key = {r.key: r for r in profile.residencies}
    by_tensor: dict[str, list[Residency]] = defaultdict(list)
    for r in profile.residencies:
        by_tensor[r.tensor].append(r)
    types = {name: (helper.tensor_dtype_to_np_dtype(t.dtype), t.shape) for name, t in graph.tensors.items()}
    roots = buffer_roots(profile)

    def region(key) -> tuple[int, int]:
        r = by_key[key]
        lo = plan.offsets.get(roots[key], 0) if r.nbytes else 0
        itemsize = types[r.tensor][0].itemsize
        if lo % itemsize:
            raise ScheduleError(f"tensor '{r.tensor}' is placed at arena offset {lo}, not a multiple of "
                                f"its element size {itemsize}")
        return lo, lo + r.nbytes

    def covering(tensor: str, step: int) -> Residency:
        for r in by_tensor[tensor]:
            if r.start <= step <= r.end:
                return r
        raise ScheduleError(f"tensor '{tensor}' is not resident at step {step}")

    def starting(tensor: str, step: int) -> Residency:
        for r in by_tensor[tensor]:
            if r.start == step:
                return r
        raise ScheduleError(f"tensor '{tensor}' gets no residency at step {step}")

    sharers = buffer_groups(profile)       # buffer -> its residencies (in-place chains, views)
    releases: list[list] = [[] for _ in range(n)]
    for r in profile.residencies:
        if 0 <= r.end < n:
            kept = any(m.key != r.key and m.start <= r.end < m.end for m in sharers[roots[r.key]])
            releases[r.end].append((r.key, *region(r.key), kept))

    host_initial_tier = _first_swap_in_tiers(plan)
    stores = rt.stores(_store_sizes(plan, host_initial_tier))
    host_initial = {t: stores[(tier, t)] for t, tier in host_initial_tier.items()}
    static_at_start = [r for r in profile.residencies if r.index == 0 and r.start == 0
                       and (r.tensor in graph.inputs or (graph.tensors[r.tensor].is_static
                                                         and r.tensor not in plan.on_host))]
    initial = [(r.key, *region(r.key)) for r in static_at_start]
    finals = _finals(plan, by_tensor, region, stores, n)

    actions: list = []
    swapped = Counter()
    pending: list[tuple[int, int, int, str, str]] = []    # event, lo, hi, kind, tensor@tier
    on_host_copy: dict[tuple[str, str], int] = {}          # (tensor, tier) -> event of its swap-out
    events = 0

    def waits_for(regions: list[tuple[int, int]]) -> list[int]:
        return sorted({e for e, lo, hi, _, _ in pending
                       if any(lo < b and a < hi for a, b in regions)})

    for i, step in enumerate(schedule):
        if step.kind in ("compute", "recompute"):
            op = graph.op_by_name[step.target]
            if step.kind == "recompute" and draws_random(op):
                raise ScheduleError(f"op '{op.name}' ({op.op_type}) draws random numbers; recomputing it "
                                    f"would change its result")
            reads = [(t, *region(covering(t, i).key)) for t in op.inputs if t]
            writes = []
            for t in op.present_outputs:
                r = starting(t, i)
                writes.append((r.key, *region(r.key), r.shares_with))
            touched = [(lo, hi) for _, lo, hi in reads] + [(lo, hi) for _, lo, hi, _ in writes]
            actions.append(_Run(op, None, None, reads, writes, waits_for(touched)))
            pending = [p for p in pending if p[0] not in actions[-1].waits]
        elif step.kind in ("swap_out", "swap_in"):
            tier = step.tier or "dram"
            t = step.target
            r = covering(t, i) if step.kind == "swap_out" else starting(t, i)
            lo, hi = region(r.key)
            store = stores[(tier, t)]
            waits = waits_for([(lo, hi)])
            if step.kind == "swap_out":
                swapped[tier] += r.nbytes
                on_host_copy[(t, tier)] = events
            elif (t, tier) in on_host_copy:
                waits = sorted(set(waits) | {on_host_copy[(t, tier)]})
            elif host_initial_tier.get(t) != tier:
                raise ScheduleError(f"tensor '{t}' is swapped in from {tier} at step {i} but no copy of it "
                                    f"was put there")
            actions.append(_Copy(step.kind, r.key, lo, hi, tier, store, events, waits))
            pending.append((events, lo, hi, step.kind, f"{t}@{tier}"))
            events += 1
        else:
            actions.append(None)
    for run in actions:   # sessions only once the whole plan has been found runnable
        if isinstance(run, _Run):
            run.session, run.binding, run.provider = rt.bind(run.op, graph, [(t, lo) for t, lo, _ in run.reads],
                                               [(k[0], lo) for k, lo, _, _ in run.writes])
    return _Program(actions, releases, initial, host_initial, finals, types, swapped, events)


def _first_swap_in_tiers(plan: Plan) -> dict[str, str]:
    """Static tensors that start on the host -> the tier their first swap-in reads."""
    tiers: dict[str, str] = {}
    for step in plan.schedule:
        if step.kind == "swap_in" and step.target in plan.on_host:
            tiers.setdefault(step.target, step.tier or "dram")
    for name in plan.on_host:
        tiers.setdefault(name, "dram")
    return tiers


def _store_sizes(plan: Plan, host_initial_tier: dict[str, str]) -> dict[tuple[str, str], int]:
    """(tier, tensor) -> bytes: one place per tensor in each tier it visits."""
    sizes = {(tier, t): plan.graph.tensors[t].nbytes for t, tier in host_initial_tier.items()}
    for step in plan.schedule:
        if step.kind in ("swap_out", "swap_in"):
            sizes[(step.tier or "dram", step.target)] = plan.graph.tensors[step.target].nbytes
    return sizes


def _finals(plan: Plan, by_tensor, region, stores, n: int) -> dict:
    """Where each graph output is at the end of the step: in the arena or in a tier's store."""
    finals = {}
    for name in plan.graph.outputs:
        last = max(by_tensor[name], key=lambda r: r.index, default=None)
        if last is not None and last.end >= n - 1:
            finals[name] = ("arena", *region(last.key))
            continue
        swapped = [s for s in plan.schedule if s.target == name and s.kind == "swap_out"]
        if last is not None and swapped and _last_event(plan, name) == "swap_out":
            finals[name] = ("store", stores[(swapped[-1].tier or "dram", name)])
        else:
            raise ScheduleError(f"graph output '{name}' is freed before the end of the step; its value "
                                f"would be lost")
    return finals


def _last_event(plan: Plan, tensor: str) -> str | None:
    kinds = [s.kind for s in plan.schedule if s.target == tensor and s.kind in ("swap_out", "swap_in", "free")]
    return kinds[-1] if kinds else None


def draws_random(op: Op) -> bool:
    """A random op, or a Dropout given a training_mode (it may draw a mask): a replay could differ."""
    return op.op_type in RANDOM_OPS or (op.op_type == "Dropout" and len(op.inputs) > 2 and bool(op.inputs[2]))


# ---- the rehearsal: the executor's own accounting -------------------------------------------
def _rehearse(program: _Program, profile: MemoryProfile) -> tuple[np.ndarray, int]:
    """Walk the byte ranges the program binds; return measured live bytes per step, high water.

    Each slot is (tensor, lo, hi). Reading a range that does not hold the tensor, or writing
    over a live slot, is a ScheduleError naming the tensor."""
    live: dict[tuple[str, int], tuple[int, int]] = {}
    high_water = 0

    ends = {r.key: r.end for r in profile.residencies}

    def allocate(key, lo, hi, shares, step):
        nonlocal high_water
        if shares is not None:
            if live.get(shares) != (lo, hi):
                raise ScheduleError(f"tensor '{key[0]}' takes the storage of '{shares[0]}' at step {step}, "
                                    f"which is not where that tensor is")
            live[key] = live[shares]
            if ends[shares] == step:      # written over; a view shares with a source read later
                del live[shares]
        else:
            if hi > lo:
                for other, (a, b) in live.items():
                    if a < hi and lo < b:
                        raise ScheduleError(f"tensor '{key[0]}' is written at step {step} over arena bytes "
                                            f"[{a},{b}) of tensor '{other[0]}', which is still live")
            live[key] = (lo, hi)
        high_water = max(high_water, hi)

    def read(tensor, lo, hi, step):
        if not any(k[0] == tensor and span == (lo, hi) for k, span in live.items()):
            raise ScheduleError(f"tensor '{tensor}' is read at step {step} from arena bytes [{lo},{hi}), "
                                f"which do not hold it (freed too early?)")

    for key, lo, hi in program.initial:
        allocate(key, lo, hi, None, 0)
    n = len(program.actions)
    measured = np.zeros(n, dtype=np.int64)
    for i, action in enumerate(program.actions):
        if isinstance(action, _Run):
            for tensor, lo, hi in action.reads:
                read(tensor, lo, hi, i)
            for key, lo, hi, shares in action.writes:
                allocate(key, lo, hi, shares, i)
        elif isinstance(action, _Copy):
            if action.kind == "swap_out":
                read(action.key[0], action.lo, action.hi, i)
            else:
                allocate(action.key, action.lo, action.hi, None, i)
        measured[i] = sum(hi - lo for lo, hi in set(live.values()))
        for key, lo, hi, kept in program.releases[i]:
            live.pop(key, None)
    planned = profile.live_bytes
    if not np.array_equal(measured, planned):
        step = int(np.argmax(measured != planned))
        raise ScheduleError(f"the executor's accounting ({int(measured[step])} bytes) disagrees with the "
                            f"memory model ({int(planned[step])} bytes) at step {step}")
    return measured, high_water


# ---- running ----------------------------------------------------------------------------
def _load(program: _Program, rt: "_Runtime", feeds: dict, statics: dict, poison: bool) -> None:
    """Put this step's inputs and initializer values where the plan starts them."""
    if poison:
        rt.fill(0, rt.arena_bytes, POISON)
    for key, lo, hi in program.initial:
        name = key[0]
        value = feeds[name] if name in feeds else statics[name]
        rt.write(lo, value)
    for name, store in program.host_initial.items():
        store[:] = np.ascontiguousarray(statics[name]).reshape(-1).view(np.uint8)


def _execute(program: _Program, rt: "_Runtime", poison: bool) -> None:
    """One step: the schedule's actions in order, releases poisoned when checking (not after
    the last action: what is live then is the step's result)."""
    last = len(program.actions) - 1
    for i, (action, releases) in enumerate(zip(program.actions, program.releases)):
        if isinstance(action, _Run):
            rt.wait(action.waits)
            action.session.run_with_iobinding(action.binding)
        elif isinstance(action, _Copy):
            rt.wait(action.waits)
            if action.kind == "swap_out":
                rt.copy_out(action.lo, action.hi, action.store, action.event)
            else:
                rt.copy_in(action.lo, action.hi, action.store, action.event)
        if poison and i < last:
            for _, lo, hi, kept in releases:
                if not kept and hi > lo:
                    rt.wait_all()
                    rt.fill(lo, hi, POISON)


def _collect(program: _Program, rt: "_Runtime") -> dict[str, np.ndarray]:
    outputs = {}
    for name, where in program.finals.items():
        dtype, shape = program.types[name]
        raw = rt.read(where[1], where[2]) if where[0] == "arena" else np.array(where[1])
        outputs[name] = raw.view(dtype).reshape(shape)
    return outputs


def _provider_name(providers: Counter) -> str:
    """One name when every op ran on one provider, else 'A+B' (most op runs first)."""
    names = [name for name, _ in providers.most_common()]
    return "+".join(names) if names else "CPUExecutionProvider"


# ---- sessions ---------------------------------------------------------------------------
def session_options(threads: int):
    """The options of every session, the reference included, so kernels and threading match."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return options


def providers_for(device: str) -> list:
    if device == "cuda":
        return [("CUDAExecutionProvider", {"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC"}),
                "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def single_op_model(op: Op, graph: Graph) -> onnx.ModelProto:
    """A model of one node with generic names i<k>/o<k>, so equal ops share one session."""
    inputs = [f"i{k}" if t else "" for k, t in enumerate(op.inputs)]
    outputs = [f"o{k}" if t else "" for k, t in enumerate(op.outputs)]
    node = _make_node(dataclasses.replace(op, name="op", inputs=inputs, outputs=outputs, doc_string=""))

    def info(names, tensors):
        return [helper.make_tensor_value_info(n, graph.tensors[t].dtype, list(graph.tensors[t].shape))
                for n, t in zip(names, tensors) if t]

    g = helper.make_graph([node], "op", info(inputs, op.inputs), info(outputs, op.outputs))
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d != MEMSCHED_DOMAIN]
    model = helper.make_model(g, opset_imports=opsets, producer_name="memsched")
    model.ir_version = graph.ir_version
    return model


class _Runtime:
    """The arena, the tier stores and the session cache for one run on one device."""

    def __init__(self, device: str, arena_bytes: int, threads: int, nvdimm_dir: str | None):
        self.device = device
        self.arena_bytes = arena_bytes
        self.threads = threads
        self.nvdimm_dir = nvdimm_dir
        self.sessions: dict[bytes, object] = {}
        self.assigned: dict[bytes, str] = {}    # session -> the provider its op's node runs on
        self._tmpdir: str | None = None
        self._mmaps: list = []
        self._cuda = _Cuda() if device == "cuda" else None
        if self._cuda is None:
            self._raw = np.empty(max(arena_bytes, 1) + ALIGN, dtype=np.uint8)
            skip = (-self._raw.ctypes.data) % ALIGN
            self.arena = self._raw[skip:skip + arena_bytes]
            self.base = self.arena.ctypes.data if arena_bytes else self._raw.ctypes.data
        else:
            import onnxruntime as ort

            self.arena = ort.OrtValue.ortvalue_from_shape_and_type([max(arena_bytes, 1)], np.uint8, "cuda", 0)
            self.base = self.arena.data_ptr()

    def __enter__(self):
        return self

    def allocated_bytes(self) -> int:
        """The size of the arena allocation as the allocator reports it."""
        if self._cuda is None:
            return int(self.arena.nbytes)
        return int(self.arena.tensor_size_in_bytes()) if self.arena_bytes else 0

    def __exit__(self, *exc):
        self.sessions.clear()
        self._mmaps.clear()   # the files are unlinked already; the mappings go with the last view
        if self._cuda is not None:
            self._cuda.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        return False

    # -- sessions
    def bind(self, op: Op, graph: Graph, reads: list[tuple[str, int]], writes: list[tuple[str, int]]):
        import onnxruntime as ort

        model = single_op_model(op, graph).SerializeToString()
        key = model + (op.name.encode() if draws_random(op) else b"")   # random ops keep their own state
        session = self.sessions.get(key)
        if session is None:
            try:
                session = ort.InferenceSession(model, session_options(self.threads),
                                               providers=providers_for(self.device))
            except Exception as exc:  # noqa: BLE001 - ORT raises several types; name the op
                raise UserError(f"ONNX Runtime cannot run {op.op_type} node '{op.name}': "
                                f"{str(exc).strip().splitlines()[0]}") from None
            self.sessions[key] = session
            self.assigned[key] = _assigned_provider(session)
        binding = session.io_binding()
        device = "cuda" if self.device == "cuda" else "cpu"
        present = [k for k, t in enumerate(op.inputs) if t]
        for k, (tensor, lo) in zip(present, reads):
            t = graph.tensors[tensor]
            binding.bind_input(f"i{k}", device, 0, t.dtype, list(t.shape), self.base + lo)
        present = [k for k, t in enumerate(op.outputs) if t]
        for k, (tensor, lo) in zip(present, writes):
            t = graph.tensors[tensor]
            binding.bind_output(f"o{k}", device, 0, t.dtype, list(t.shape), self.base + lo)
        return session, binding, self.assigned[key]

    # -- the host tiers
    def stores(self, sizes: dict[tuple[str, str], int]) -> dict[tuple[str, str], np.ndarray]:
        """One uint8 view per (tier, tensor): DRAM in host memory (pinned on CUDA), NVDIMM in a
        memory-mapped file in nvdimm_dir (a temp dir by default)."""
        views = {}
        for tier in sorted({tier for tier, _ in sizes}):
            items = sorted((t, n) for (tr, t), n in sizes.items() if tr == tier)
            total = sum(n for _, n in items)
            buffer = self._tier_buffer(tier, total)
            offset = 0
            for t, n in items:
                views[(tier, t)] = buffer[offset:offset + n]
                offset += n
        return views

    def _tier_buffer(self, tier: str, nbytes: int) -> np.ndarray:
        if tier == "nvdimm":
            directory = self.nvdimm_dir
            if directory is None:
                self._tmpdir = directory = tempfile.mkdtemp(prefix="memsched-nvdimm-")
            try:
                handle = tempfile.NamedTemporaryFile(dir=directory, prefix="memsched-", suffix=".nvdimm")
            except OSError as exc:
                raise UserError(f"cannot create the NVDIMM store in {directory}: {exc.strerror}") from None
            with handle:
                mm = np.memmap(handle.name, dtype=np.uint8, mode="w+", shape=(max(nbytes, 1),))
            self._mmaps.append(mm)
            return mm
        if tier != "dram":
            raise ScheduleError(f"unknown host tier '{tier}' (tiers: dram, nvdimm)")
        if self._cuda is not None:
            return self._cuda.pinned(nbytes)
        return np.empty(nbytes, dtype=np.uint8)

    # -- bytes in and out of the arena
    def write(self, lo: int, value: np.ndarray) -> None:
        data = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        if self._cuda is None:
            self.arena[lo:lo + data.size] = data
        else:
            self._cuda.copy(self.base + lo, data.ctypes.data, data.size, _Cuda.H2D)

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self._cuda is None:
            return self.arena[lo:hi].copy()
        out = np.empty(hi - lo, dtype=np.uint8)
        self._cuda.copy(out.ctypes.data, self.base + lo, hi - lo, _Cuda.D2H)
        return out

    def fill(self, lo: int, hi: int, byte: int) -> None:
        if self._cuda is None:
            self.arena[lo:hi] = byte
        else:
            self._cuda.memset(self.base + lo, byte, hi - lo)

    def copy_out(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        if self._cuda is None:
            store[:] = self.arena[lo:hi]
        else:
            self._cuda.copy_async(store.ctypes.data, self.base + lo, hi - lo, _Cuda.D2H, event)

    def copy_in(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        if self._cuda is None:
            self.arena[lo:hi] = store
        else:
            self._cuda.copy_async(self.base + lo, store.ctypes.data, hi - lo, _Cuda.H2D, event)

    def wait(self, events: list[int]) -> None:
        if self._cuda is not None and events:
            self._cuda.wait(events)

    def wait_all(self) -> None:
        if self._cuda is not None:
            self._cuda.synchronize()

    def synchronize(self) -> None:
        self.wait_all()


def _assigned_provider(session) -> str:
    """Where ONNX Runtime put the op's node (not the Casts or copies it added around it); a
    CUDA session whose node fell back to CPU says CPUExecutionProvider."""
    try:
        for subgraph in session.get_provider_graph_assignment_info():
            if any(node.name == "op" for node in subgraph.get_nodes()):
                return subgraph.ep_name
    except (AttributeError, RuntimeError):   # an ONNX Runtime without assignment records
        pass
    return session.get_providers()[0]


def _resolve_device(device: str) -> tuple[str, str | None]:
    """'cuda' when a CUDA arena and session can really be made, else 'cpu' and the reason."""
    if device == "cpu":
        return "cpu", None
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "cpu", "this ONNX Runtime build has no CUDA execution provider"
    ort.set_default_logger_severity(4)   # we report the reason ourselves, once
    try:
        ort.OrtValue.ortvalue_from_shape_and_type([1], np.uint8, "cuda", 0)
        _Cuda().close()
        probe = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                                  [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
        model = helper.make_model(probe, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        session = ort.InferenceSession(model.SerializeToString(), session_options(1),
                                       providers=providers_for("cuda"))
        if "CUDAExecutionProvider" not in session.get_providers():    # ORT dropped it (libraries missing)
            return "cpu", "ONNX Runtime could not register its CUDA execution provider here"
    except Exception as exc:  # noqa: BLE001 - any failure means no usable CUDA
        reason = re.sub(r"^.*\) ", "", str(exc).strip().splitlines()[-1])   # drop ORT's source location
        return "cpu", f"CUDA is not usable here: {reason[:160]}"
    finally:
        ort.set_default_logger_severity(2)  # ONNX Runtime's default: warnings
    return "cuda", None


class _Cuda:
    """The few CUDA runtime calls the executor needs (ctypes over libcudart): pinned host
    buffers and async copies on two copy streams (d2h, h2d), each copy with an event."""

    H2D, D2H = 1, 2

    def __init__(self):
        self.lib = _load_cudart()
        self.streams = {self.D2H: self._stream(), self.H2D: self._stream()}
        self.events: dict[int, ctypes.c_void_p] = {}
        self.pinned_buffers: list[ctypes.c_void_p] = []

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise UserError(f"CUDA call {name} failed with error {status}")

    def _stream(self) -> ctypes.c_void_p:
        stream = ctypes.c_void_p()
        self._call("cudaStreamCreate", ctypes.byref(stream))
        return stream

    def pinned(self, nbytes: int) -> np.ndarray:
        ptr = ctypes.c_void_p()
        self._call("cudaHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)), 0)
        self.pinned_buffers.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value))[:nbytes]

    def copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        """A blocking copy: done on the device before it returns (ORT's stream does not wait
        for the legacy default stream, so a pageable upload must finish here)."""
        self._call("cudaMemcpy", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind)
        self.synchronize()

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, event: int) -> None:
        stream = self.streams[kind]
        self._call("cudaMemcpyAsync", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                   kind, stream)
        if event not in self.events:
            handle = ctypes.c_void_p()
            self._call("cudaEventCreateWithFlags", ctypes.byref(handle), 2)   # disable timing
            self.events[event] = handle
        self._call("cudaEventRecord", self.events[event], stream)

    def wait(self, events: list[int]) -> None:
        for e in events:
            if e in self.events:
                self._call("cudaEventSynchronize", self.events[e])

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        self._call("cudaMemset", ctypes.c_void_p(ptr), byte, ctypes.c_size_t(nbytes))
        self.synchronize()

    def synchronize(self) -> None:
        self._call("cudaDeviceSynchronize")

    def close(self) -> None:
        self.lib.cudaDeviceSynchronize()
        for handle in self.events.values():
            self.lib.cudaEventDestroy(handle)
        for stream in self.streams.values():
            self.lib.cudaStreamDestroy(stream)
        for ptr in self.pinned_buffers:
            self.lib.cudaFreeHost(ptr)
        self.events.clear()
        self.pinned_buffers.clear()


def _load_cudart():
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise UserError("the CUDA runtime library (libcudart) was not found")


# ---- the reference run --------------------------------------------------------------------
class _Reference:
    """The unscheduled graph in one plain ONNX Runtime session, initializers fed as inputs."""

    def __init__(self, graph: Graph, device: str, threads: int):
        import onnxruntime as ort

        model = reference_model(graph)
        self.outputs = list(graph.outputs)
        self.session = ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                            providers=providers_for(device))

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


__all__ = ["run_plan", "RunResult", "prepare_inputs", "feed_back", "compare_outputs", "reference_model",
           "single_op_model", "session_options", "providers_for"]
