"""The bundled executor: run a Plan on ONNX Runtime exactly as scheduled, in one arena.

Why its own executor: a plan's memory figures are only believable when a real run keeps
to them. The schedule's op runs are cut into segments, each a stretch of consecutive op
runs (on CUDA up to the next swap and up to an op that waits for a copy; on the CPU a swap
copy is an Identity node of the segment, bound from the arena to its store), and each segment
runs as one ONNX Runtime session through IOBinding: every tensor its ops read from outside is
a session input and every tensor they write is a session output, bound at its planned offset
in one preallocated arena (a numpy buffer on CPU, one device allocation on CUDA). ONNX
Runtime therefore allocates no tensor of its own; the sessions have no initializers and no
memory arena of their own (kernels' scratch comes from one arena that all of them share,
memsched.ort.shared_scratch_arena, kept from step to step), are built once and reused by
every step. Parameters, buffers and optimizer state live only in the arena: the first step
loads them from the graph, later steps move each `<name>.updated` into its place. Constants
and fixed integer values (shapes, axes) are read from host arrays (`host_constants`).
Swap-outs copy bytes to a host tier's store (DRAM: host buffers, pinned on CUDA; NVDIMM: a
memory-mapped file) and swap-ins copy them back; recomputations re-run the op; frees
release the slot.

Before anything runs the plan is judged (memory.validate: residency, budget, placement),
then rehearsed: the executor walks the byte ranges it is about to bind, keeping its own
table of live slots. A read of a range that does not hold the tensor, or a write over a
live slot, is a ScheduleError naming the tensor; the live bytes of that table are the
measured figures, and they must equal the memory model's at every step. The process's real
memory (RSS growth, `RunResult.process`) is measured beside them: the arena, the stores and
what the executor costs on top.

`check=True` also runs the unscheduled graph in one plain ONNX Runtime session (same
options: the same graph optimisations, see memsched.ort.OPTIMIZATION, same thread count,
every initializer fed as an input so no kernel sees a constant the segments do not) and
compares every output of every step; on CPU they must be bit-identical. Bytes released
during a checked run are filled with NaN bytes after the segment or copy that released them
(those not written again by then), so a plan that read freed memory could not pass by luck.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import re
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import dtypes
from .errors import ScheduleError, UserError
from .ir import Graph, Op, _make_node, tensor_value
from .cuda import device_memory, load_cudart
from .measure import ProcessMemory, release_free_heap, require_host_memory
from .memory import MemoryProfile, Residency, buffer_groups, buffer_roots, check_placement, validate
from .onnx_utils import MEMSCHED_DOMAIN
from .ops import CONSTANT_OPS, HOISTED_OPS, VIEW_OPS, draws_random
from .ort import (bind_addresses, bound_session, check_threads, device_buffer, node_providers, providers_for,
                  reference_session, resolve_device, warm_environment)
from .schedule import Plan

DEVICES = ("cpu", "cuda")
POISON = 0xFF        # every float made of these bytes is a NaN
ALIGN = 64           # the arena's base address alignment
FIXED_CACHE_BYTES = 64 * 1024    # statics up to this size are decoded once per run, not every step


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
    outputs: dict[str, np.ndarray]  # the last step's outputs (on CPU: read-only views of the arena)
    sessions: int                   # ONNX Runtime sessions built (one per segment)
    ops: int                        # op runs per step (computes and recomputes)
    swapped_bytes: dict[str, int]   # tier -> bytes copied out per step
    check: dict | None = None       # max_abs_diff, passed, exact, per_output, steps
    process: dict | None = None     # the process's real memory (see `_process_memory`)
    threads: int = 0                # intra-op threads of every session (0: ONNX Runtime's default)

    @property
    def step_time_s(self) -> float:
        return steady_step_time(self.step_times)


def steady_step_time(times: list[float]) -> float:
    """The step time a run reports: the median, the first step left out where there are others,
    since it also faults in the arena's pages and grows the shared scratch arena (ResNet-18's
    small step: 0.16 s, then 0.11-0.12 s)."""
    return float(np.median(times[1:] if len(times) > 1 else times))


def run_plan(plan: Plan, steps: int = 1, device: str = "cpu", check: bool = False,
             inputs: dict[str, np.ndarray] | None = None, nvdimm_dir: str | None = None,
             progress: Callable[[int, int], None] | None = None, threads: int = 0,
             given: Graph | None = None, allow_fallback: bool = True, against: Graph | None = None,
             before: dict[int, Callable] | None = None, after: dict[int, Callable] | None = None) -> RunResult:
    """Run `steps` training steps of `plan`; with `check`, compare against a plain ORT run.

    Multi-step runs feed each `<tensor>.updated` output back as `<tensor>` for the next step
    (moved within the arena; the step time includes those moves, not the loading of inputs).
    `progress(done, total)` is called after each step. `threads`: intra-op threads of every
    session, 0 for ONNX Runtime's default (every core); 1 times kernels on the calling thread.
    `given`: the graph as the user gave it, where the plan's differs from it by rewrites that
    change rounding only (fused updates); with `check`, the step is also compared to a plain
    run of it, within CUDA_TOLERANCE (`check["given"]`). `against`: the step rebuilt from the
    user's original model, with the same inputs and outputs as the plan's graph but its own
    initializers (weights); with `check`, compared the same way (`check["against"]`), so a plan
    whose ops, constants or weights differ from the model's fails. Without `allow_fallback`, a
    CUDA request that CUDA here cannot serve is a UserError instead of a run on the CPU.

    `before` and `after` (CPU only): schedule step -> a callable run, every step, just before
    that step's op runs (given its inputs) or just after (given its outputs), each as a
    {tensor: numpy view of its bytes in the arena}: a caller's way to act on tensors in place
    between ops (memsched.distributed all-reduces gradients so). Those steps' ops start and end
    sessions of their own; what the callables take is inside the step time.

    On CUDA a checked run keeps float32 kernels off TF32 tensor cores, in its sessions and in
    the reference's: cuDNN picks its algorithms per session, and two TF32 algorithms of one
    convolution differ by up to 7e-4 of the weights they update (ResNet-50's small step on an
    H200), which would hide the plan's own errors; without TF32 the two runs differ by 1e-7
    to 6e-6 there."""
    warm_environment()     # before memory is measured: the library's code is any ORT user's
    memory = ProcessMemory()
    if steps < 1:
        raise UserError(f"--steps must be at least 1, not {steps}")
    graph = plan.graph
    feeds = prepare_inputs(graph, inputs)
    hooks = Hooks(before or {}, after or {})
    device_memory_use = _DeviceMemory() if device == "cuda" and resolve_device(device)[0] == "cuda" else None
    with PlanRunner(plan, device, threads, nvdimm_dir, feeds, hooks, allow_fallback, tf32=not check) as runner:
        program, rt, profile = runner.program, runner.rt, runner.profile
        setup_growth = memory.growth()
        if device_memory_use is not None:
            device_memory_use.sample()
        actual_device = runner.device
        reference = _Reference(graph, actual_device, threads, tf32=False) if check else None
        ref_statics = _statics(graph) if check else {}
        others = {key: g for key, g in (("given", given), ("against", against)) if check and g is not None}
        other_runs = {key: _Reference(g, actual_device, threads, tf32=False) for key, g in others.items()}
        other_statics = {key: _statics(g) for key, g in others.items()}
        other_diffs: dict[str, list] = {key: [] for key in others}
        times, diffs = [], []
        outputs: dict[str, np.ndarray] = {}
        for k in range(steps):
            times.append(runner.step(feeds, poison=check))
            if k == steps - 1:
                growth = memory.growth()       # the outputs are in the arena; copying them out is the caller's
                file_growth = memory.file_growth()
                if device_memory_use is not None:
                    device_memory_use.sample()
            if check or k == steps - 1:
                outputs = _collect(program, rt, last=k == steps - 1)
            if reference is not None:
                expected = reference.run(feeds, ref_statics)
                diffs.append(compare_outputs(outputs, expected))
                ref_statics = feed_back(graph, ref_statics, expected)
            for key, other in others.items():       # within tolerance: these graphs round differently
                expected = other_runs[key].run(feeds, other_statics[key])
                other_diffs[key].append(compare_outputs(outputs, expected))
                other_statics[key] = feed_back(other, other_statics[key], expected)
            if progress is not None:
                progress(k + 1, steps)
        providers = Counter(run.provider for run in program.actions if isinstance(run, _Run))
        sessions, allocated, stored = len(program.segments), rt.allocated_bytes(), rt.store_bytes()
        fallback, live, high_water = runner.fallback, runner.live, runner.high_water
    return RunResult(
        requested_device=device, provider=_provider_name(providers), providers=dict(providers),
        fallback=fallback, steps=steps, arena_bytes=allocated, arena_high_water=high_water,
        peak_bytes=int(live.max()) if len(live) else 0, live_bytes=live,
        planned_arena_bytes=runner.planned_arena, planned_peak_bytes=profile.peak_bytes, step_times=times,
        outputs=outputs, sessions=sessions, ops=sum(isinstance(a, _Run) for a in program.actions),
        swapped_bytes=dict(program.swapped_bytes),
        check=({**_check_summary(diffs, exact=actual_device == "cpu"),
                **{key: _check_summary(other_diffs[key], exact=False) if key in others else None
                   for key in ("given", "against")}}
               if check else None),
        process={**_process_memory(memory, setup_growth, growth, file_growth, allocated, stored, actual_device,
                                   check),
                 "device": device_memory_use.summary(allocated) if device_memory_use is not None else None},
        threads=threads)


class PlanRunner:
    """A plan made ready to run step after step: judged (memory.validate), lowered to a
    program over one arena, rehearsed byte by byte, its ONNX Runtime sessions built and bound
    once. `run_plan` and `memsched.trainer.Trainer` step it; it is a context manager that
    releases the arena, the stores and the sessions.

    `feeds` are the arrays the graph inputs are read from: on the CPU those read in place
    (`host_inputs`) stay bound at these arrays' addresses for every step, so a caller that
    feeds new batches copies each into them (the trainer does). Each `step` moves the last
    step's `<name>.updated` outputs to where `<name>` starts (`_advance`), loads the inputs and
    the statics no update brings (`values` give some of them other values than the graph's:
    the trainer's hyperparameters), and runs the program. After `reload()` the next step loads
    every static again instead of advancing (from `values`, else the graph)."""

    def __init__(self, plan: Plan, device: str = "cpu", threads: int = 0, nvdimm_dir: str | None = None,
                 feeds: dict[str, np.ndarray] | None = None, hooks: "Hooks | None" = None,
                 allow_fallback: bool = True, tf32: bool = True):
        if device not in DEVICES:
            raise UserError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")
        check_threads(threads)
        self.profile = validate(plan)
        if plan.offsets is None:
            raise UserError("the plan has no arena offsets; place it first (the placement pass of "
                            "`memsched compile` assigns them)")
        self.planned_arena = check_placement(self.profile, plan.offsets)
        self.plan, self.graph = plan, plan.graph
        self.device, self.fallback = resolve_device(device)
        if self.device != "cuda":
            require_host_memory(self.planned_arena, "the plan's arena")
        if self.fallback is not None and not allow_fallback:
            raise UserError(f"cannot run on {device}: {self.fallback}; pass --allow-fallback to run on the CPU "
                            f"instead")
        hooks = hooks or Hooks({}, {})
        if (hooks.before or hooks.after) and self.device != "cpu":
            raise UserError("step hooks (data-parallel all-reduces) run on the CPU only")
        self.hooks = hooks
        feeds = feeds if feeds is not None else {}
        self.rt = _Runtime(self.device, self.planned_arena, threads, nvdimm_dir, tf32=tf32)
        try:
            self.rt.host_values = host_constants(self.graph, feeds, self.device)
            if not (hooks.before or hooks.after):       # hooks are handed the arena's bytes
                self.rt.host_inputs = host_inputs(plan, feeds, self.device)
                self.rt.host_values.update(self.rt.host_inputs)
            self.program = _compile(plan, self.profile, self.rt, hooks)
            self.live, self.high_water = _rehearse(self.program, self.profile)
        except BaseException:
            self.rt.__exit__(None, None, None)
            raise
        self.steps = 0          # steps run since the statics were last loaded
        self._roots = input_roots(plan, list(self.graph.inputs))
        # the small statics loaded again every step (constants, hyperparameters), decoded once
        names = [key[0] for key, _, _ in self.program.initial] + list(self.program.host_initial)
        self._fixed = {name: tensor_value(self.graph.tensors[name], self.graph.base_dir) for name in names
                       if self.graph.tensors[name].is_static and name not in self.program.updated
                       and self.graph.tensors[name].nbytes <= FIXED_CACHE_BYTES}

    def __enter__(self) -> "PlanRunner":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def close(self) -> None:
        self.rt.__exit__(None, None, None)

    @property
    def host_inputs(self) -> dict[str, np.ndarray]:
        """The inputs (and views of them) read in place from the feeds' arrays."""
        return self.rt.host_inputs

    def bind_input(self, name: str, array: np.ndarray) -> None:
        """From the next step on, read graph input `name` (one of `host_inputs`) in place from
        `array`, and its views too: every session reading them is bound to its bytes, no copy
        made. `array` must be C-contiguous, of the input's dtype and shape, and outlive its use."""
        for tensor, root in self._roots.items():
            if root == name and tensor in self.rt.host_inputs:
                value = array.reshape(self.graph.tensors[tensor].shape)
                self.rt.host_inputs[tensor] = self.rt.host_values[tensor] = value
                for binding, session_input in self.rt.host_reads.get(tensor, ()):
                    binding.bind_cpu_input(session_input, value)

    def step(self, feeds: dict[str, np.ndarray], values: dict[str, np.ndarray] | None = None,
             poison: bool = False) -> float:
        """Run one step; return its seconds (the moves of the updates and the run, not the
        loading of inputs). With `poison`, unheld arena bytes are NaN bytes first and bytes
        are poisoned as they are released (a checked run)."""
        start = time.perf_counter()
        if self.steps:
            _advance(self.program, self.rt)
        moved = time.perf_counter() - start
        _load(self.program, self.rt, self.graph, feeds, first=self.steps == 0, poison=poison,
              values={**self._fixed, **values} if values else self._fixed)
        start = time.perf_counter()
        _execute(self.program, self.rt, poison=poison, hooks=self.hooks)
        self.rt.synchronize()
        self.steps += 1
        return moved + time.perf_counter() - start

    def reload(self) -> None:
        """Make the next step load every static again (from its `values`, else the graph)
        instead of moving the updates into place."""
        self.steps = 0

    def read(self, name: str) -> np.ndarray:
        """A copy of graph output `name` as the last step left it."""
        where = self.program.finals[name]
        dtype, shape = self.program.types[name]
        raw = self.rt.read(where[1], where[2]) if where[0] == "arena" else np.array(where[1])
        return raw.view(dtype).reshape(shape)


def _process_memory(memory: ProcessMemory, setup_growth: int | None, growth: int | None,
                    file_growth: int | None, arena: int, stored: int, device: str, check: bool) -> dict:
    """The process's real memory during the run, next to what the plan accounts for.

    `rss_growth_bytes`: peak RSS from the start of `run_plan` (ONNX Runtime loaded and its
    environment made, memsched.ort.warm_environment) to the end
    of the last step, before its outputs are copied out of the arena (sessions, arena, stores,
    kernels' scratch, the executor's own objects; with `check`, the reference sessions and
    their runs too) less RSS at the start; `setup_growth_bytes`: the same once the sessions
    are built, before the first step. `overhead_bytes`: the growth less the arena (on CPU)
    and the host stores: what running costs beyond the plan's bytes. `file_growth_bytes`: the
    part of the resident set that is file-backed pages paged in meanwhile (RssFile), mostly
    ONNX Runtime's and numpy's code for kernels run for the first time, which any process
    running them pays. On CUDA the arena is device memory, outside RSS."""
    host_arena = arena if device == "cpu" else 0
    available = memory.available and growth is not None
    return {
        "rss_source": "/proc/self/status (VmRSS, VmHWM)" if available else "unavailable",
        "rss_start_bytes": memory.start if available else None,
        "rss_growth_bytes": growth if available else None,
        "setup_growth_bytes": setup_growth if available else None,
        "arena_bytes": arena,
        "host_arena_bytes": host_arena,
        "store_bytes": stored,
        "overhead_bytes": growth - host_arena - stored if available else None,
        "file_growth_bytes": file_growth if available else None,
        "includes_check": check,
    }


class _DeviceMemory:
    """The run's real device memory, from outside the plan's accounting: free device memory
    (cudaMemGetInfo) when the run starts (the CUDA context already made) and after setup and
    after the last step. The drop is the arena, ONNX Runtime's CUDA workspace and whatever else
    the run allocated; sampled, so it is a lower bound of the peak between samples."""

    def __init__(self):
        self.cudart = load_cudart()
        self.start, self.total = device_memory(self.cudart)
        self.lowest = self.start

    def sample(self) -> None:
        self.lowest = min(self.lowest, device_memory(self.cudart)[0])

    def summary(self, arena: int) -> dict:
        used = self.start - self.lowest
        return {"source": "cudaMemGetInfo at the start, after setup and after the last step",
                "total_bytes": self.total, "growth_bytes": used, "arena_bytes": arena,
                "overhead_bytes": used - arena}


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


def _check_summary(per_step: list[dict[str, dict]], exact: bool) -> dict:
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


# ---- the program: what each schedule step binds --------------------------------------------
@dataclass
class _Run:
    op: Op
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
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


@dataclass
class _Segment:
    """Consecutive op runs in one session: its inputs and outputs bound into the arena."""

    runs: list[_Run]
    first: int          # schedule step of its first run
    last: int           # schedule step of its last run
    steps: set = field(default_factory=set)    # schedule steps of its runs
    session: object = None
    binding: object = None
    waits: list[int] = field(default_factory=list)
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


@dataclass
class _Const:
    """A Constant op's run: its value, computed once, written at its offset."""

    run: _Run
    step: int
    lo: int
    data: np.ndarray    # the value's bytes
    waits: list[int] = field(default_factory=list)
    hoisted: bool = False   # written before the segment its step falls in
    poison: list[tuple[int, int]] = field(default_factory=list)   # released bytes to poison after it


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
    items: list = field(default_factory=list)      # what runs, in order: _Segment and _Copy
    updates: list = field(default_factory=list)    # moves that put `<name>.updated` where `<name>` starts

    @property
    def segments(self) -> list[_Segment]:
        return [item for item in self.items if isinstance(item, _Segment)]

    @property
    def updated(self) -> set[str]:
        """Statics whose next-step value a move brings (so they are not loaded again)."""
        return {name for name, _, _ in self.updates}


def _compile(plan: Plan, profile: MemoryProfile, rt: "_Runtime", hooks: "Hooks") -> _Program:
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
            actions.append(_Run(op, reads, writes, waits_for(touched)))
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
    program = _Program(actions, releases, initial, host_initial, finals, types, swapped, events)
    program.updates = _updates(plan, program, region)
    items = []        # sessions only once the whole plan has been found runnable
    # ONNX Runtime adds nodes of its own around float16 kernels it runs in float32 (Casts): those
    # run out of index order, so such a step is cut for any order. On CUDA it may add copies
    # between devices; a segment where it did is found at build (_adds_no_nodes) and re-cut.
    inserts = any(t.dtype in dtypes.HALF_TYPES for t in graph.tensors.values())
    order = _OrderGuard.ANY if inserts else _OrderGuard.ORDERED
    unwritten = _unwritten(plan, rt.host_values)
    # on the CPU a swap copy is a node of the session around it (in the order given, which
    # ORDERED keeps), so swaps do not end sessions; elsewhere a copy is a step of its own
    copy_base = rt.base if rt.device == "cpu" and order == _OrderGuard.ORDERED else None
    for item in _items(program.actions, graph, rt.device == "cuda", order, hooks, unwritten, copy_base):
        if isinstance(item, _Segment) and not rt.build(item, graph, exact=order == _OrderGuard.ORDERED):
            # ONNX Runtime's record of the nodes it assigned differs from the segment's: the
            # segment is cut where any order would be wrong
            parts = _items([r if i in item.steps else None for i, r in enumerate(program.actions)], graph,
                           rt.device == "cuda", _OrderGuard.ANY, hooks)
            for part in parts:
                rt.build(part, graph, exact=False)
            items.extend(parts)
        else:
            items.append(item)
    for run in program.actions:          # a Constant is written, or read from the host: no session runs it
        if isinstance(run, _Run) and run.op.op_type in CONSTANT_OPS:
            run.provider = providers_for(rt.device)[0] if rt.device == "cpu" else "CUDAExecutionProvider"
    program.items = _with_poison(items, program, profile, region)
    return program


def constant_value(op: Op, graph: Graph) -> np.ndarray:
    """The bytes of a Constant op's output, as the graph types it: a `value` tensor read
    directly, any other form through onnx's reference evaluator (imported only then: it
    weighs megabytes)."""
    t = graph.tensors[op.outputs[0]]
    if isinstance(op.attributes.get("value"), onnx.TensorProto):
        value = numpy_helper.to_array(op.attributes["value"])
    else:
        from onnx.reference import ReferenceEvaluator

        node = _make_node(dataclasses.replace(op, name="constant", inputs=[], outputs=["y"], doc_string=""))
        opsets = [helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d != MEMSCHED_DOMAIN]
        model = helper.make_model(helper.make_graph([node], "constant", [], [helper.make_tensor_value_info(
            "y", t.dtype, list(t.shape))]), opset_imports=opsets)
        model.ir_version = graph.ir_version
        value = np.asarray(ReferenceEvaluator(model).run(None, {})[0])
    dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
    if value.dtype != dtype or value.shape != t.shape:
        raise ScheduleError(f"Constant op '{op.name}' makes {value.dtype} of shape {value.shape}, but the graph "
                            f"says {dtype} of shape {t.shape}")
    return np.ascontiguousarray(value).reshape(-1).view(np.uint8)


# integer tensors: shapes, axes, indices; the CUDA provider reads the shape-like ones on the host
_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32})
# on CUDA, a float Constant larger than this stays in the arena (a host one is uploaded every run)
HOST_CONSTANT_BYTES = 64 * 1024


def host_constants(graph: Graph, feeds: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """The values read from host arrays instead of the arena, by tensor: every Constant output
    (on CUDA the float ones up to HOST_CONSTANT_BYTES), and every integer tensor whose value is
    the same in every step: Shape and Size outputs (shapes are static) and integer initializers
    no update replaces.

    Two reasons. ONNX Runtime's CUDA kernels take shape-like inputs (Reshape's shape,
    Unsqueeze's and ReduceSum's axes, Slice's starts...) in host memory; bound on the device,
    such an input is copied to the host as the run starts, and that copy was seen read before
    it had landed (an Unsqueeze's axes read as 0, a Reshape's shape as another tensor's). And a
    Constant that no one reads from the arena needs no write there (`_items`), so it no longer
    ends a segment where its bytes were another tensor's. On the CPU a host array is bound as
    the arena is, without a copy."""
    updated = {name.removesuffix(".updated") for name in graph.outputs if name.endswith(".updated")}
    producer = graph.producer
    values: dict[str, np.ndarray] = {}
    for name, t in graph.tensors.items():
        if t.shape is None or t.dtype in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            continue
        dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
        integer = t.dtype in _INTEGER_TYPES
        op = producer.get(name)
        if op is not None and op.op_type in CONSTANT_OPS:
            if not integer and device == "cuda" and t.nbytes > HOST_CONSTANT_BYTES:
                continue
            value = constant_value(op, graph).view(dtype)
        elif not integer:
            continue
        elif op is None:
            if not t.is_static or name in updated or name in feeds:
                continue
            value = tensor_value(t, graph.base_dir)
        elif op.op_type in ("Shape", "Size") and graph.tensors[op.inputs[0]].shape is not None:
            shape = graph.tensors[op.inputs[0]].shape
            if op.op_type == "Size":
                value = np.array(math.prod(shape))
            else:
                start, end = op.attributes.get("start", 0), op.attributes.get("end", len(shape))
                value = np.array(shape[slice(start, end)])
        else:
            continue
        values[name] = np.array(value, dtype=dtype).reshape(t.shape)    # a copy, 0-d kept 0-d
    return values


def host_inputs(plan: Plan, feeds: dict, device: str = "cpu") -> dict[str, np.ndarray]:
    """On the CPU, the graph inputs read in place from the caller's arrays instead of copies in
    the arena, by tensor, with the shape views that share their storage (a Flatten of the
    batch): the view is bound at its input's address, where ONNX Runtime's view kernels copy
    nothing. A plain session reads its feeds so; a copy of the batch in the arena would be
    memory the step does not need. An input stays in the arena where an op writes over its
    storage (an in-place op over one of its views), where the plan swaps it or a view of it,
    or where it or a view is a graph output. The plan still places their bytes; those pages
    of the arena are never touched."""
    if device != "cpu":
        return {}
    graph = plan.graph
    moved = _swapped(plan)
    root = input_roots(plan, [name for name in graph.inputs if name in feeds])
    written = {root[source] for out, source in plan.aliases.items()
               if source in root and graph.producer[out].op_type not in VIEW_OPS}
    kept = {root[t] for t in root if t in moved or t in graph.outputs} | written
    values = {}
    for name, base in root.items():
        if base not in kept:
            values[name] = feeds[base].reshape(graph.tensors[name].shape)
    return values


def input_roots(plan: Plan, inputs: list[str]) -> dict[str, str]:
    """Each of graph inputs `inputs`, and each shape view sharing its storage, -> the input."""
    root = {name: name for name in inputs}
    for op in plan.graph.ops:             # graph order: a view's input is rooted before it
        if op.op_type in VIEW_OPS and op.present_inputs and op.present_inputs[0] in root:
            root.update({out: root[op.present_inputs[0]] for out in op.present_outputs
                         if plan.aliases.get(out) == op.present_inputs[0]})
    return root


def _swapped(plan: Plan) -> set[str]:
    """The tensors `plan` swaps out or in somewhere in the step."""
    return {s.target for s in plan.schedule if s.kind in ("swap_out", "swap_in")}


def _unwritten(plan: Plan, host_values: dict) -> frozenset[str]:
    """Constant outputs read only by runs, and from host arrays: no write of them is needed
    (not a step output, never swapped)."""
    graph = plan.graph
    moved = _swapped(plan)
    producer = graph.producer
    return frozenset(t for t in host_values if t in producer and producer[t].op_type in CONSTANT_OPS
                     and t not in graph.outputs and t not in moved)


def _items(actions: list, graph: Graph, split_at_waits: bool, order: str, hooks: "Hooks",
           unwritten: frozenset[str] = frozenset(), copy_base: int | None = None) -> list:
    """The program as it runs: segments of consecutive op runs, cut at every copy (and on CUDA
    at every run that waits for one, so a copy overlaps the runs before it), before and after
    each run that has `hooks`, and wherever the `_OrderGuard` (in mode `order`) refuses a run,
    and the copies; Constant ops (CONSTANT_OPS) become writes of their value, except those in
    `unwritten` (read from host arrays only), which need none. With `copy_base` (the arena's
    address, on the CPU) a copy is a run of the segment instead (`_copy_run`)."""
    items: list = []
    current: _Segment | None = None
    guard = _OrderGuard(order)
    for i, action in enumerate(actions):
        if isinstance(action, _Copy) and copy_base is not None:
            action = _copy_run(action, copy_base)
        if isinstance(action, _Run) and action.op.op_type in CONSTANT_OPS:
            if action.op.outputs[0] in unwritten:
                continue
            const = _Const(action, i, action.writes[0][1], constant_value(action.op, graph), list(action.waits))
            if current is not None and not action.waits and guard.hoist(action):
                const.hoisted = True              # written before the segment: no run of it touches the bytes
                items.insert(items.index(current), const)
            else:
                items.append(const)
                current = None
        elif isinstance(action, _Run):
            if current is None or (split_at_waits and action.waits) or i in hooks.before \
                    or current.last in hooks.after or not guard.admit(action):
                current = _Segment([], i, i, waits=list(action.waits))
                items.append(current)
                guard = _OrderGuard(order)
                guard.admit(action)
            current.runs.append(action)
            current.last = i
            current.steps.add(i)
        elif isinstance(action, _Copy):
            items.append(action)
            current = None
    return items


def _copy_run(copy: _Copy, base: int) -> _Run:
    """A swap copy as the run of an Identity node from the tensor's bytes to its store's, or
    back; the store's place is given as an offset from the arena's address `base`, so the
    session binds it as it binds the arena. ONNX Runtime's CPU Identity copies its input's
    bytes into its output's where the two are bound apart."""
    tensor = copy.key[0]
    store = copy.store.ctypes.data - base
    arena, host = (copy.lo, copy.hi), (store, store + copy.hi - copy.lo)
    source, target = (arena, host) if copy.kind == "swap_out" else (host, arena)
    op = Op(f"{copy.kind}/{tensor}", "Identity", [tensor], [tensor])
    return _Run(op, [(tensor, *source)], [(copy.key, *target, None)], list(copy.waits))


def _with_poison(items: list, program: _Program, profile: MemoryProfile, region) -> list:
    """`items`, each given the bytes released up to its end that no live tensor holds after
    it: what a checked run poisons once the item has run (not after the last step of the
    schedule, where what is live is the step's result)."""
    n = len(program.actions)
    done = 0
    for item in items:
        if isinstance(item, _Const) and item.hoisted:
            continue           # the segment after it poisons what was released up to its end
        end = (item.last if isinstance(item, _Segment) else item.step if isinstance(item, _Const)
               else program.actions.index(item))
        released = [(lo, hi) for step in range(done, min(end, n - 2) + 1)
                    for _, lo, hi, kept in program.releases[step] if not kept and hi > lo]
        live = [region(r.key) for r in profile.residencies
                if r.start <= end and (end < r.end or r.end >= n - 1) and r.nbytes]
        item.poison = _subtract(_union(released), _union(live))
        done = end + 1
    return items


class _OrderGuard:
    """Whether a segment runs as scheduled in the order ONNX Runtime picks.

    A session runs its nodes in a topological order of its own, and the plan reuses bytes: a
    run may write where a tensor that is no longer needed was. That is safe only if every run
    that read or wrote those bytes before runs first. The executor's sessions use ONNX
    Runtime's priority-based order: Kahn's algorithm that takes Shape and Size nodes as soon as
    they are ready and every other node in the order given (the schedule's, a topological
    order), so only a Shape or Size run can move, and only earlier. In mode ORDERED a
    Shape or Size run's writes, and in mode ANY (for a session where ONNX Runtime added nodes
    of its own, which run out of that order) every run's writes, must only cover bytes that
    runs reached through data edges (its ancestors) touched before, so that any such order
    runs them first. `admit` adds a run to the segment when that holds, and refuses it (the
    segment ends there) when it does not."""

    ORDERED, ANY = "ordered", "any"

    def __init__(self, order: str):
        self.order = order
        self.spans: list[list[int]] = []                     # [lo, hi, runs that touched them (bits)]
        self.ancestors: list[int] = []                       # per run: the runs it depends on (bits)
        self.written: dict[str, tuple[int, int, int, int]] = {}   # tensor -> lo, hi, span index, run
        self.outside: dict[tuple[str, int], int] = {}        # tensor read from outside, lo -> span index

    def hoist(self, run: _Run) -> bool:
        """Whether a run that reads nothing (a Constant) can be done before the segment: no run
        of the segment touched the bytes it writes. If so, those bytes count as read from
        outside from here on."""
        if run.reads or any(a < hi and lo < b for _, lo, hi, _ in run.writes for a, b, _ in self.spans):
            return False
        for key, lo, hi, _ in run.writes:
            self.spans.append([lo, hi, 0])
        return True

    def admit(self, run: _Run) -> bool:
        j = len(self.ancestors)
        me, before = 1 << j, 0
        inner = []
        for tensor, lo, hi in run.reads:
            w = self.written.get(tensor)
            if w is not None and w[:2] == (lo, hi):
                before |= (1 << w[3]) | self.ancestors[w[3]]
                inner.append(w[2])
            else:
                inner.append(None)
        allowed = before | me
        checked = run.writes if self.order == self.ANY or run.op.op_type in HOISTED_OPS else []
        for _, lo, hi, _ in checked:
            if any(a < hi and lo < b and touched & ~allowed for a, b, touched in self.spans):
                return False
        for (tensor, lo, hi), span in zip(run.reads, inner):
            if span is None:
                span = self.outside.get((tensor, lo))
                if span is None:
                    span = self.outside[(tensor, lo)] = len(self.spans)
                    self.spans.append([lo, hi, 0])
            self.spans[span][2] |= me
        for key, lo, hi, _ in run.writes:
            self.written[key[0]] = (lo, hi, len(self.spans), j)
            self.spans.append([lo, hi, me])
        self.ancestors.append(before)
        return True


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _subtract(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`spans` less `holes` (both sorted, disjoint)."""
    result = []
    for lo, hi in spans:
        for a, b in holes:
            if b <= lo or a >= hi:
                continue
            if a > lo:
                result.append((lo, a))
            lo = max(lo, b)
        if lo < hi:
            result.append((lo, hi))
    return result


def _same_place(a: tuple, b: tuple) -> bool:
    """Whether two places (see `_updates`) are the same bytes: a store's place holds an array
    view, compared by its address and size (== on arrays compares their elements)."""
    if a[0] != b[0]:
        return False
    if a[0] == "store":
        return (a[1].__array_interface__["data"][0], a[1].nbytes) == (b[1].__array_interface__["data"][0], b[1].nbytes)
    return a == b


def _updates(plan: Plan, program: _Program, region) -> list[tuple[str, tuple | None, list]]:
    """Per static with a `<name>.updated` output of its type: where it starts a step and the
    moves, in a safe order, that put the update there (none where the update is written in
    place).

    A place is ('arena', lo, hi), ('store', view) or ('temp', k). Moving one update may
    overwrite the arena bytes where another update still waits, so moves run in an order in
    which none overwrites a source still to be read; a cycle is broken by copying one source
    to a temporary first (('stash', k, place) before the moves)."""
    graph = plan.graph
    starts = {key[0]: ("arena", lo, hi) for key, lo, hi in program.initial}
    starts.update({name: ("store", view) for name, view in program.host_initial.items()})
    pending = []
    for name in starts:
        t, updated = graph.tensors[name], graph.tensors.get(f"{name}.updated")
        if not t.is_static or updated is None or f"{name}.updated" not in program.finals:
            continue
        if updated.shape != t.shape or updated.dtype != t.dtype:
            continue
        where = program.finals[f"{name}.updated"]
        source = ("arena", where[1], where[2]) if where[0] == "arena" else ("store", where[1])
        pending.append((name, source, starts[name]))

    def overlaps(a, b) -> bool:
        return a[0] == b[0] == "arena" and a[1] < b[2] and b[1] < a[2]

    order: list[tuple[str, tuple | None, list]] = []
    temps = 0
    while pending:
        for k, (name, source, target) in enumerate(pending):
            if not any(j != k and overlaps(target, other[1]) for j, other in enumerate(pending)):
                order.append((name, target, [] if _same_place(source, target) else [("move", source, target)]))
                pending.pop(k)
                break
        else:
            name, source, target = pending[0]
            order.append((name, None, [("stash", temps, source)]))
            pending[0] = (name, ("temp", temps), target)
            temps += 1
    return order


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
    """Where each graph output is at the end of the step: in the arena, or in a tier's store
    where it was swapped out and not resident at the end (swapped in again for a reader and
    freed after it, its host copy still holds the value: tensors are written once)."""
    finals = {}
    for name in plan.graph.outputs:
        last = max(by_tensor[name], key=lambda r: r.index, default=None)
        if last is not None and last.end >= n - 1:
            finals[name] = ("arena", *region(last.key))
            continue
        swapped = [s for s in plan.schedule if s.target == name and s.kind == "swap_out"]
        if last is not None and swapped:     # a value never changes: its host copy holds it still
            finals[name] = ("store", stores[(swapped[-1].tier or "dram", name)])
        else:
            raise ScheduleError(f"graph output '{name}' is freed before the end of the step; its value "
                                f"would be lost")
    return finals


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
    # compared as lists: np.array_equal pages in 192 KiB of numpy's code, a seventh of the
    # overhead a small step's run has beside its arena
    planned = profile.live_bytes.tolist()
    if measured.tolist() != planned:
        step = next(i for i, (m, p) in enumerate(zip(measured.tolist(), planned)) if m != p)
        raise ScheduleError(f"the executor's accounting ({int(measured[step])} bytes) disagrees with the "
                            f"memory model ({planned[step]} bytes) at step {step}")
    return measured, high_water


# ---- running ----------------------------------------------------------------------------
def _load(program: _Program, rt: "_Runtime", graph: Graph, feeds: dict, first: bool, poison: bool,
          values: dict[str, np.ndarray] | None = None) -> None:
    """Put this step's inputs where the plan starts them (but those read in place from the
    caller's arrays, `host_inputs`), and the statics no update brings:
    every static on the first step (read from the graph one at a time, so no second copy of
    the parameters is kept; each passes through a transient copy, the bytes of its
    TensorProto, which the C heap keeps resident once freed until it gives its free pages
    back, after the first load), constants again on later steps (a freed one's bytes are
    reused). `values` replace the graph's value of the statics they name. With `poison`, every
    other byte of the arena is NaN bytes first."""
    values = values or {}
    keep = [] if first else [target[1:] for _, target, _ in program.updates if target and target[0] == "arena"]
    if poison:
        for lo, hi in _subtract([(0, rt.arena_bytes)], _union(keep)):
            rt.fill(lo, hi, POISON)
    updated = set() if first else program.updated
    for key, lo, hi in program.initial:
        name = key[0]
        if name in feeds:
            if name not in rt.host_inputs:
                rt.write(lo, feeds[name])
        elif name not in updated:
            value = values.get(name)
            rt.write(lo, value if value is not None else tensor_value(graph.tensors[name], graph.base_dir))
    for name, store in program.host_initial.items():
        if name not in updated:
            value = values.get(name)
            value = np.ascontiguousarray(value if value is not None else tensor_value(graph.tensors[name],
                                                                                      graph.base_dir))
            store[:] = value.reshape(-1).view(np.uint8)
    if first:
        release_free_heap()


def _advance(program: _Program, rt: "_Runtime") -> None:
    """Move each `<name>.updated` of the step that ran to where `<name>` starts the next one."""
    temps: dict[int, np.ndarray] = {}
    for _, _, moves in program.updates:
        for op, a, b in moves:
            if op == "stash":
                temps[a] = rt.fetch(b)
            else:
                rt.put(b, temps.pop(a[1]) if a[0] == "temp" else a)


def _execute(program: _Program, rt: "_Runtime", poison: bool, hooks: "Hooks") -> None:
    """One step: the segments, constants and copies in order, released bytes poisoned when
    checking; the `hooks` around the steps that have them."""
    for item in program.items:
        rt.wait(item.waits)
        if isinstance(item, _Segment):
            if item.first in hooks.before:
                hooks.before[item.first](_views(rt, program, item.runs[0].reads))
            item.session.run_with_iobinding(item.binding)
            if item.last in hooks.after:
                written = [(key[0], lo, hi) for key, lo, hi, _ in item.runs[-1].writes]
                hooks.after[item.last](_views(rt, program, written))
        elif isinstance(item, _Const):
            rt.write(item.lo, item.data)
        elif item.kind == "swap_out":
            rt.copy_out(item.lo, item.hi, item.store, item.event)
        else:
            rt.copy_in(item.lo, item.hi, item.store, item.event)
        if poison and item.poison:
            rt.wait_all()
            for lo, hi in item.poison:
                rt.fill(lo, hi, POISON)


@dataclass
class Hooks:
    """Callables around schedule steps (run_plan's `before` and `after`)."""

    before: dict[int, Callable]
    after: dict[int, Callable]


def _views(rt: "_Runtime", program: _Program, spans: list[tuple[str, int, int]]) -> dict[str, np.ndarray]:
    """{tensor: its bytes in the (CPU) arena as a writable array of its type and shape}."""
    return {t: rt.arena[lo:hi].view(program.types[t][0]).reshape(program.types[t][1]) for t, lo, hi in spans}


def _collect(program: _Program, rt: "_Runtime", last: bool) -> dict[str, np.ndarray]:
    """The step's outputs. After the `last` step on CPU they are read-only views of the arena
    and the stores, which nothing writes any more (no second copy of the updated parameters);
    otherwise copies."""
    views = last and rt.device == "cpu"
    outputs = {}
    for name, where in program.finals.items():
        dtype, shape = program.types[name]
        if where[0] == "arena":
            raw = rt.arena[where[1]:where[2]] if views else rt.read(where[1], where[2])
        else:
            raw = where[1] if views else np.array(where[1])
        outputs[name] = raw.view(dtype).reshape(shape)
        if views:
            outputs[name].flags.writeable = False
    return outputs


def _adds_no_nodes(saved: str, names: set[str]) -> bool:
    """Whether the graph ONNX Runtime saved after partitioning (`optimized_model_filepath`)
    holds only the segment's own nodes: no copy between devices was added, which would run
    out of the segment's order. False where nothing was saved (nothing is assumed)."""
    try:
        nodes = onnx.load(saved, load_external_data=False).graph.node
    except Exception:  # noqa: BLE001 - unreadable or absent: assume nothing
        return False
    return {node.name for node in nodes} == names


def _provider_name(providers: Counter) -> str:
    """One name when every op ran on one provider, else 'A+B' (most op runs first)."""
    names = [name for name, _ in providers.most_common()]
    return "+".join(names) if names else "CPUExecutionProvider"


# ---- sessions ---------------------------------------------------------------------------
def segment_model(segment: _Segment, graph: Graph) -> tuple[onnx.ModelProto, list, list]:
    """The segment's ops as one model whose every tensor is a graph input or output.

    Values are named by what holds them, not by tensor: `x<k>` for a tensor read from outside
    the segment, `v<k>` for each one a run writes (a recomputed tensor is a new value), so the
    model is in SSA form whatever the schedule replays. Nodes are named `n<j>`, the j-th run.
    A float16 value read inside the segment reaches its readers through an Identity written
    onto its own bytes, as in the reference (`_fp16_barriers`): without it ONNX Runtime's CPU
    provider, running ops without a float16 kernel in float32 between Casts, drops the Cast
    pair between two of them and passes the float32 value on, unrounded.
    Returns the model, its inputs [(value, tensor, lo)] and its outputs [(value, tensor, lo)]."""
    inputs: dict[tuple[str, int], str] = {}
    written: dict[str, tuple[str, int, int]] = {}    # tensor -> (value, lo, hi) of its latest write
    barriers: dict[str, str] = {}                    # float16 value -> its Identity's output
    ins, outs, nodes = [], [], []
    for j, run in enumerate(segment.runs):
        op = run.op
        reads = iter(run.reads)
        names = []
        for t in op.inputs:
            if not t:
                names.append("")
                continue
            tensor, lo, hi = next(reads)
            if tensor in written and written[tensor][1:] == (lo, hi):
                value = written[tensor][0]
                if graph.tensors[tensor].dtype == onnx.TensorProto.FLOAT16:
                    if value not in barriers:
                        barriers[value] = f"{value}.fp16"
                        nodes.append(helper.make_node("Identity", [value], [barriers[value]], name=f"b{value}"))
                        outs.append((barriers[value], tensor, lo))
                    value = barriers[value]
                names.append(value)
                continue
            if (tensor, lo) not in inputs:
                inputs[(tensor, lo)] = f"x{len(inputs)}"
                ins.append((inputs[(tensor, lo)], tensor, lo))
            names.append(inputs[(tensor, lo)])
        writes = iter(run.writes)
        results = []
        for t in op.outputs:
            if not t:
                results.append("")
                continue
            _, lo, hi, _ = next(writes)
            value = f"v{len(outs)}"
            written[t] = (value, lo, hi)
            outs.append((value, t, lo))
            results.append(value)
        nodes.append(_make_node(dataclasses.replace(op, name=f"n{j}", inputs=names, outputs=results, doc_string="")))

    def info(values):
        return [helper.make_tensor_value_info(v, graph.tensors[t].dtype, list(graph.tensors[t].shape))
                for v, t, _ in values]

    g = helper.make_graph(nodes, "segment", info(ins), info(outs))
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opset_imports.items() if d != MEMSCHED_DOMAIN]
    model = helper.make_model(g, opset_imports=opsets, producer_name="memsched")
    model.ir_version = graph.ir_version
    return model, ins, outs


class _Runtime:
    """The arena, the tier stores and the session cache for one run on one device."""

    def __init__(self, device: str, arena_bytes: int, threads: int, nvdimm_dir: str | None, tf32: bool = True):
        self.device = device
        self.tf32 = tf32                         # float32 kernels on CUDA may use TF32 tensor cores
        self.arena_bytes = arena_bytes
        self.threads = threads
        self.nvdimm_dir = nvdimm_dir
        self.sessions: list = []
        self.stored = 0                          # bytes of the host tiers' stores
        self._tmpdir: str | None = None          # the NVDIMM store's folder, where none was given
        self._saved_dir: str | None = None       # where ONNX Runtime saves a CUDA segment's graph
        self._mmaps: list = []
        self._cuda = _Cuda() if device == "cuda" else None
        self.host_values: dict[str, np.ndarray] = {}   # tensor -> value its readers read from host memory
        self.host_inputs: dict[str, np.ndarray] = {}   # ... of them, the inputs and views read in place
        self.host_reads: dict[str, list] = {}          # such a tensor -> (binding, session input) reading it
        if self._cuda is None:
            self._raw = np.empty(max(arena_bytes, 1) + ALIGN, dtype=np.uint8)
            skip = (-self._raw.ctypes.data) % ALIGN
            self.arena = self._raw[skip:skip + arena_bytes]
            self.base = self.arena.ctypes.data if arena_bytes else self._raw.ctypes.data
        else:
            self.arena = device_buffer(arena_bytes)
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
        for directory in (self._tmpdir, self._saved_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        return False

    # -- sessions
    def build(self, segment: _Segment, graph: Graph, exact: bool) -> bool:
        """Make the segment's session and bind its inputs and outputs at their arena offsets.

        With `exact`, the segment was cut for ONNX Runtime's priority order of the nodes as
        given: if ORT added nodes of its own (or keeps no record of its nodes) no session is
        kept and the answer is False."""
        model, inputs, outputs = segment_model(segment, graph)
        stream = self._cuda.compute.value if self._cuda is not None else None
        saved = None
        if exact and self._cuda is not None:
            if self._saved_dir is None:
                self._saved_dir = tempfile.mkdtemp(prefix="memsched-segments-")
            saved = f"{self._saved_dir}/segment.onnx"
        try:
            session = bound_session(model.SerializeToString(), self.threads, self.device, stream, saved, self.tf32)
        except Exception as exc:  # noqa: BLE001 - ORT raises several types; name the op
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            found = re.search(r"\bn(\d+)\b", message)
            op = segment.runs[int(found.group(1)) if found and int(found.group(1)) < len(segment.runs) else 0].op
            raise UserError(f"ONNX Runtime cannot run {op.op_type} node '{op.name}': "
                            f"{re.sub(r'^.*?] ', '', message)}") from None
        assigned = node_providers(session)
        names = {node.name for node in model.graph.node}
        if exact and (set(assigned) != names or len(segment.runs) == 0
                      or (saved is not None and not _adds_no_nodes(saved, names))):
            return False
        def at(value: str, tensor: str, lo: int) -> tuple:
            t = graph.tensors[tensor]
            held = self.host_inputs.get(tensor)       # a view of an input read in place
            return value, t.dtype, t.shape, self.base + lo if held is None else held.ctypes.data

        host = {value: self.host_values[tensor] for value, tensor, _ in inputs if tensor in self.host_values}
        binding = bind_addresses(session, self.device, [at(*i) for i in inputs if i[0] not in host],
                                 [at(*o) for o in outputs], host)
        for value, tensor, _ in inputs:
            if tensor in self.host_inputs:
                self.host_reads.setdefault(tensor, []).append((binding, value))
        for j, run in enumerate(segment.runs):
            run.provider = assigned.get(f"n{j}", session.get_providers()[0])
        segment.session, segment.binding = session, binding
        self.sessions.append(session)
        return True

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
                try:      # the blocks now: a mapped sparse file past the free space dies of SIGBUS
                    os.posix_fallocate(handle.fileno(), 0, max(nbytes, 1))
                    full = None
                except OSError as exc:
                    full, mm = exc, None
            if full is not None:
                if self._tmpdir is not None:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                    self._tmpdir = None
                raise UserError(f"cannot reserve {nbytes:,} bytes for the NVDIMM store in {directory}: "
                                f"{full.strerror or full}")
            self._mmaps.append(mm)
            self.stored += nbytes
            return mm
        if tier != "dram":
            raise ScheduleError(f"unknown host tier '{tier}' (tiers: dram, nvdimm)")
        self.stored += nbytes
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

    def store_bytes(self) -> int:
        """Bytes of the host tiers' stores (DRAM and NVDIMM)."""
        return self.stored

    def fetch(self, place: tuple) -> np.ndarray:
        """A host copy of the bytes at `place` (('arena', lo, hi) or ('store', view))."""
        return self.read(place[1], place[2]) if place[0] == "arena" else np.array(place[1])

    def put(self, place: tuple, source) -> None:
        """Copy `source` (a place, or host bytes) to `place`; arena to arena stays on the device."""
        if place[0] == "store":
            place[1][:] = self.fetch(source) if isinstance(source, tuple) else source
        elif not isinstance(source, tuple) or source[0] == "store":
            self.write(place[1], source if not isinstance(source, tuple) else source[1])
        elif self._cuda is None:
            self.arena[place[1]:place[2]] = self.arena[source[1]:source[2]]
        elif place[1] < source[2] and source[1] < place[2]:
            # cudaMemcpy's result is undefined where the two ranges overlap: go through the host
            self.write(place[1], self.read(source[1], source[2]))
        else:
            self._cuda.copy(self.base + place[1], self.base + source[1], source[2] - source[1], _Cuda.D2D)

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


class _Cuda:
    """The few CUDA runtime calls the executor needs (ctypes over libcudart): pinned host
    buffers, the compute stream every session's kernels run on (ONNX Runtime's
    `user_compute_stream`), and async copies on two copy streams (d2h, h2d), each copy with an
    event and each ordered after the kernels issued before it (an event on the compute stream
    the copy stream waits for), so a swap-out never reads a tensor still being written and a
    swap-in never overwrites bytes a kernel still reads."""

    H2D, D2H, D2D = 1, 2, 3

    def __init__(self):
        self.lib = load_cudart()
        self.compute = self._stream()
        self.streams = {self.D2H: self._stream(), self.H2D: self._stream()}
        self.events: dict[int, ctypes.c_void_p] = {}
        self.computed = self._event()        # recorded on the compute stream before each copy
        self.pinned_buffers: list[ctypes.c_void_p] = []

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise UserError(f"CUDA call {name} failed with error {status}")

    def _stream(self) -> ctypes.c_void_p:
        stream = ctypes.c_void_p()
        self._call("cudaStreamCreateWithFlags", ctypes.byref(stream), 1)    # cudaStreamNonBlocking
        return stream

    def _event(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._call("cudaEventCreateWithFlags", ctypes.byref(handle), 2)     # cudaEventDisableTiming
        return handle

    def pinned(self, nbytes: int) -> np.ndarray:
        ptr = ctypes.c_void_p()
        self._call("cudaHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)), 0)
        self.pinned_buffers.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value))[:nbytes]

    def copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        """A blocking copy, after every kernel issued before it (a run bound to device memory
        may return before its kernels end, and the legacy default stream does not wait for
        the compute stream) and done on the device before it returns."""
        self._call("cudaStreamSynchronize", self.compute)
        self._call("cudaMemcpy", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind)
        self.synchronize()

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, event: int) -> None:
        stream = self.streams[kind]
        self._call("cudaEventRecord", self.computed, self.compute)
        self._call("cudaStreamWaitEvent", stream, self.computed, 0)
        self._call("cudaMemcpyAsync", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                   kind, stream)
        if event not in self.events:
            self.events[event] = self._event()
        self._call("cudaEventRecord", self.events[event], stream)

    def wait(self, events: list[int]) -> None:
        for e in events:
            if e in self.events:
                self._call("cudaEventSynchronize", self.events[e])

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        """A blocking fill, ordered as `copy`."""
        self._call("cudaStreamSynchronize", self.compute)
        self._call("cudaMemset", ctypes.c_void_p(ptr), byte, ctypes.c_size_t(nbytes))
        self.synchronize()

    def synchronize(self) -> None:
        self._call("cudaDeviceSynchronize")

    def close(self) -> None:
        self.lib.cudaDeviceSynchronize()
        for handle in [*self.events.values(), self.computed]:
            self.lib.cudaEventDestroy(handle)
        for stream in [*self.streams.values(), self.compute]:
            self.lib.cudaStreamDestroy(stream)
        for ptr in self.pinned_buffers:
            self.lib.cudaFreeHost(ptr)
        self.events.clear()
        self.pinned_buffers.clear()


# ---- the reference run --------------------------------------------------------------------
class _Reference:
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


__all__ = ["run_plan", "RunResult", "prepare_inputs", "feed_back", "compare_outputs", "reference_model",
           "segment_model"]
