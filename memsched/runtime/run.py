"""Running a plan: `run_plan` (steps, the check, what was measured) and `PlanRunner` (a plan
made ready to step: judged, lowered, rehearsed, its sessions bound), the inputs, and each
step's loading, execution and outputs."""
import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..cuda import Nvml, device_memory, fixed_overhead, load_cudart
from ..errors import UserError
from ..ir import Graph, tensor_value
from ..measure import ProcessMemory, prepare_inputs, release_free_heap, require_host_memory
from ..memory import check_placement, validate
from ..ort import check_threads, resolve_device, warm_environment
from ..schedule import Plan, StepKind
from .check import Reference, check_summary, compare_outputs, feed_back, statics
from .device import POISON, Runtime
from .program import (Const, Hooks, Program, Run, Segment, host_constants, host_inputs, input_roots, lower, subtract,
                      union)
from .rehearsal import rehearse

DEVICES = ("cpu", "cuda")
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
    between ops (memsched.runtime.distributed all-reduces gradients so). Those steps' ops start and end
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
        checks = _Checks(graph, given, against, actual_device, threads) if check else None
        times: list[float] = []
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
            if checks is not None:
                checks.compare(outputs, feeds)
            if progress is not None:
                progress(k + 1, steps)
        providers = Counter(run.provider for run in program.actions if isinstance(run, Run))
        sessions, allocated, stored = len(program.segments), rt.allocated_bytes(), rt.store_bytes()
        fallback, live, high_water = runner.fallback, runner.live, runner.high_water
    return RunResult(
        requested_device=device, provider=_provider_name(providers), providers=dict(providers),
        fallback=fallback, steps=steps, arena_bytes=allocated, arena_high_water=high_water,
        peak_bytes=int(live.max()) if len(live) else 0, live_bytes=live,
        planned_arena_bytes=runner.planned_arena, planned_peak_bytes=profile.peak_bytes, step_times=times,
        outputs=outputs, sessions=sessions, ops=sum(isinstance(a, Run) for a in program.actions),
        swapped_bytes=dict(program.swapped_bytes),
        check=checks.summary(exact=actual_device == "cpu") if checks is not None else None,
        process={**_process_memory(memory, setup_growth, growth, file_growth, allocated, stored, actual_device,
                                   check),
                 "device": device_memory_use.summary(allocated) if device_memory_use is not None else None,
                 "device_reason": None if device_memory_use is not None else CPU_DEVICE_REASON},
        threads=threads)


class _Checks:
    """The reference runs a checked run compares each step's outputs with: a plain ONNX Runtime
    run of the plan's graph (exact on the CPU), and of the graph as given and the step rebuilt
    from the user's model where those are known (within tolerance: they round differently).
    Each reference feeds its own updated state back, step after step."""

    def __init__(self, graph: Graph, given: Graph | None, against: Graph | None, device: str, threads: int):
        self.graphs = {"plan": graph, **{key: g for key, g in (("given", given), ("against", against))
                                         if g is not None}}
        self.runs = {key: Reference(g, device, threads, tf32=False) for key, g in self.graphs.items()}
        self.statics = {key: statics(g) for key, g in self.graphs.items()}
        self.diffs: dict[str, list] = {key: [] for key in self.graphs}

    def compare(self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> None:
        for key, graph in self.graphs.items():
            expected = self.runs[key].run(feeds, self.statics[key])
            self.diffs[key].append(compare_outputs(outputs, expected))
            self.statics[key] = feed_back(graph, self.statics[key], expected)

    def summary(self, exact: bool) -> dict:
        return {**check_summary(self.diffs["plan"], exact=exact),
                **{key: check_summary(self.diffs[key], exact=False) if key in self.diffs else None
                   for key in ("given", "against")}}


class PlanRunner:
    """A plan made ready to run step after step: judged (memory.validate), lowered to a
    program over one arena, rehearsed byte by byte, its ONNX Runtime sessions built and bound
    once. `run_plan` and `memsched.runtime.Trainer` step it; it is a context manager that
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
        self.rt = Runtime(self.device, self.planned_arena, threads, nvdimm_dir, tf32=tf32)
        try:
            self.rt.host_values = host_constants(self.graph, feeds, self.device)
            if not (hooks.before or hooks.after):       # hooks are handed the arena's bytes
                self.rt.host_inputs = host_inputs(plan, feeds, self.device)
                self.rt.host_values.update(self.rt.host_inputs)
            self.program = lower(plan, self.profile, self.rt, hooks)
            self.rt.bind(self.program, self.graph, self.profile, hooks)
            self.live, self.high_water = rehearse(self.program, self.profile)
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
    after the last step, and at the same points NVML's figure for this process (the CUDA
    context included). The drop in free memory is the arena, ONNX Runtime's CUDA workspace and
    whatever else the run allocated; sampled, so both are lower bounds of the peak between
    samples. Set next to them: what the plan accounts for, the three parts a process that runs
    it holds (`accounted`)."""

    def __init__(self):
        self.cudart = load_cudart()
        self.start, self.total = device_memory(self.cudart)
        self.lowest = self.start
        try:
            self.nvml: Nvml | None = Nvml()
        except UserError:
            self.nvml = None
        self.process_peak: int | None = None
        self.sample()

    def sample(self) -> None:
        self.lowest = min(self.lowest, device_memory(self.cudart)[0])
        used = self.nvml.process_bytes(os.getpid()) if self.nvml is not None else None
        if used is not None:
            self.process_peak = max(self.process_peak or 0, used)

    def summary(self, arena: int) -> dict:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
        used = self.start - self.lowest
        return {"source": "cudaMemGetInfo at the start, after setup and after the last step",
                "total_bytes": self.total, "growth_bytes": used, "arena_bytes": arena,
                "overhead_bytes": used - arena, **device_accounting(arena, self.process_peak)}


def device_accounting(arena: int, measured: int | None) -> dict:
    """The device memory a process running the plan holds, in the three parts it accounts for:
    the plan's arena, the host-pinned stores' device share (none: page-locked host memory
    takes no device memory) and the fixed per-process overhead `memsched doctor` measures
    (memsched.cuda.fixed_overhead); next to the `measured` total (NVML's figure for this
    process, or None with the reason)."""
    overhead = fixed_overhead()
    fixed = overhead.get("bytes")
    accounted = arena + fixed if fixed is not None else None
    return {
        "accounted": {"arena_bytes": arena, "pinned_store_device_bytes": 0, "fixed_overhead_bytes": fixed,
                      "total_bytes": accounted,
                      "fixed_overhead_source": overhead.get("source") or overhead.get("reason")},
        "measured_total_bytes": measured,
        "measured_source": ("NVML's figure for this process at the start, after setup and after the last step"
                            if measured is not None else "not measured: NVML lists no device memory for this "
                            "process id (no NVML, or the driver counts it under another pid namespace)"),
        "measured_over_accounted": measured / accounted if measured is not None and accounted else None,
    }


CPU_DEVICE_REASON = ("the run was on the CPU: its arena is host memory (host_arena_bytes), and there is no device "
                     "memory to account")


# ---- running ----------------------------------------------------------------------------
def _load(program: Program, rt: "Runtime", graph: Graph, feeds: dict, first: bool, poison: bool,
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
        for lo, hi in subtract([(0, rt.arena_bytes)], union(keep)):
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


def _advance(program: Program, rt: "Runtime") -> None:
    """Move each `<name>.updated` of the step that ran to where `<name>` starts the next one."""
    temps: dict[int, np.ndarray] = {}
    for _, _, moves in program.updates:
        for op, a, b in moves:
            if op == "stash":
                temps[a] = rt.fetch(b)
            else:
                rt.put(b, temps.pop(a[1]) if a[0] == "temp" else a)


def _execute(program: Program, rt: "Runtime", poison: bool, hooks: "Hooks") -> None:
    """One step: the segments, constants and copies in order, released bytes poisoned when
    checking; the `hooks` around the steps that have them."""
    for item in program.items:
        rt.wait(item.waits)
        if isinstance(item, Segment):
            if item.first in hooks.before:
                hooks.before[item.first](_views(rt, program, item.runs[0].reads))
            item.session.run_with_iobinding(item.binding)
            if item.last in hooks.after:
                written = [(key[0], lo, hi) for key, lo, hi, _ in item.runs[-1].writes]
                hooks.after[item.last](_views(rt, program, written))
        elif isinstance(item, Const):
            rt.write(item.lo, item.data)
        elif item.kind == StepKind.SWAP_OUT:
            rt.copy_out(item.lo, item.hi, item.store, item.event)
        else:
            rt.copy_in(item.lo, item.hi, item.store, item.event)
        if poison and item.poison:
            rt.wait_all()
            for lo, hi in item.poison:
                rt.fill(lo, hi, POISON)




def _views(rt: "Runtime", program: Program, spans: list[tuple[str, int, int]]) -> dict[str, np.ndarray]:
    """{tensor: its bytes in the (CPU) arena as a writable array of its type and shape}."""
    return {t: rt.arena[lo:hi].view(program.types[t][0]).reshape(program.types[t][1]) for t, lo, hi in spans}


def _collect(program: Program, rt: "Runtime", last: bool) -> dict[str, np.ndarray]:
    """The step's outputs. After the `last` step, with the arena in host memory, they are read-only views of the arena
    and the stores, which nothing writes any more (no second copy of the updated parameters);
    otherwise copies."""
    views = last and rt.arena is not None
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


def _provider_name(providers: Counter) -> str:
    """One name when every op ran on one provider, else 'A+B' (most op runs first)."""
    names = [name for name, _ in providers.most_common()]
    return "+".join(names) if names else "CPUExecutionProvider"
