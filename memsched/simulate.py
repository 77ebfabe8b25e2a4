"""The event simulator: how long a Plan's step takes, and where it waits on transfers.

The memory model (memsched.memory) stays the judge of bytes; the simulator adds time. It
walks the schedule once, in order (O(steps)), on three streams:

  compute  compute and recompute steps, one after another in schedule order;
  d2h      swap_out steps in schedule order; a swap-out starts once the step that made its
           tensor resident (compute, or a swap-in) has finished and the previous d2h
           transfer is done;
  h2d      swap_in steps in schedule order; a swap-in is issued at its position: it starts
           once every compute step before it has finished (the compute stream has reached
           it), the previous h2d transfer is done, and that tensor's swap-out has completed
           (its host copy exists; static tensors the plan starts on the host have one at 0).

A compute step also waits for the swap-ins of its inputs to complete. The link's two
directions run at the same time; transfer times come from `Hardware.transfer_time` (link
and tier latency, the slower of link and tier bandwidth). Op times come from
`memsched.cost.op_time` (roofline or measured table). Free steps take no time.

Buffer reuse. The memory model ends a swapped-out tensor's residency at the swap_out step s,
so steps after s are counted without its bytes: s is the point by which its storage must be
back. Hence a step k > s that allocates (starts a residency that is not in-place and has
bytes: a compute producing a new tensor, a swap-in) does not start before that swap-out
completes. With arena offsets in the plan this is refined to what the placement says: k
waits only for swap-outs whose arena range overlaps a buffer k allocates. A swap_out placed
late in the schedule (just before its bytes are needed) therefore overlaps the compute in
between; placed early, it stalls the next allocating step by the transfer time minus the
overlap.

Memory over time maps each residency of the memory model onto the simulated clock: it is
allocated when the step that makes it starts (time 0 for what is resident at the start; an
in-place output when its op ends, as its source's storage passes to it) and released when its
last step ends (a swap-out's transfer end; the compute clock at that step for a free; the end
of the whole step for what is held to the end). Under the step rule this timeline never
exceeds the memory model's peak.

Host tiers: the copy of a tensor in a tier exists from its first swap-out there (step 0 for a
tensor that starts on the host) until its last swap-in from there, or to the end of the step
if it is not read back after its last swap-out. A plan whose host copies exceed a tier's
capacity at some step is an error; so is a swap-in from a tier that holds no copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import hardware as hardware_mod
from .cost import CostTable, op_time
from .errors import ScheduleError, UserError
from .hardware import Hardware
from .memory import MemoryProfile, analyze_plan, buffer_roots, check_placement
from .schedule import COPIES, Plan, RUNS, StepKind


@dataclass(frozen=True)
class Event:
    """One interval on one stream (a Gantt bar). `step` is the index in the schedule."""

    stream: str
    kind: str
    target: str
    step: int
    start: float
    end: float
    nbytes: int = 0
    tier: str | None = None


@dataclass
class Simulation:
    """The simulated step. Times in seconds, bytes exact."""

    step_time: float                     # when the last stream goes idle
    compute_busy: float                  # sum of compute/recompute durations
    stall: float                         # compute-stream idle time spent waiting on transfers
    stream_busy: dict[str, float]        # stream -> busy seconds
    traffic: dict[str, dict[str, int]]   # tier -> {'out': bytes swapped out, 'in': bytes swapped in}
    host_peak: dict[str, int]            # tier -> most bytes held there at once
    events: list[Event]
    step_start: list[float]
    step_end: list[float]
    memory_times: list[float]            # device bytes are memory_by_kind[k][i] from memory_times[i] on
    memory_by_kind: dict[str, list[int]]
    profile: MemoryProfile = field(repr=False)
    hardware: str | None = None
    cost_source: str = "roofline"

    @property
    def peak_bytes(self) -> int:
        """Most device bytes live at one time (never above the memory model's peak without offsets)."""
        if not self.memory_times:
            return 0
        return int(np.sum([np.asarray(v, dtype=np.int64) for v in self.memory_by_kind.values()], axis=0).max())

    def on(self, stream: str) -> list[Event]:
        return [e for e in self.events if e.stream == stream]

    def to_dict(self, timeline: bool = True) -> dict:
        d = {
            "hardware": self.hardware,
            "cost_source": self.cost_source,
            "step_time_s": self.step_time,
            "compute_busy_s": self.compute_busy,
            "stall_s": self.stall,
            "stream_busy_s": self.stream_busy,
            "traffic_bytes": self.traffic,
            "swapped_bytes": {tier: t["out"] for tier, t in self.traffic.items()},
            "host_peak_bytes": self.host_peak,
            "peak_bytes": self.peak_bytes,
            "model_peak_bytes": self.profile.peak_bytes,
        }
        if timeline:
            # the shapes memsched.figures.gantt_svg and memory_timeline_svg take (times in seconds)
            d["events"] = [{"stream": e.stream, "kind": e.kind, "label": e.target, "step": e.step,
                            "start": e.start, "end": e.end, "bytes": e.nbytes, "tier": e.tier}
                           for e in self.events]
            d["memory_timeline"] = {"x": self.memory_times, "xlabel": "time (s)", "by_kind": self.memory_by_kind}
        return d


def simulate(plan: Plan, hardware: "Hardware | str | None" = None, costs: CostTable | None = None) -> Simulation:
    """Run `plan` on the simulated streams. Op times from `costs` if given, else the roofline on
    `hardware` (default: the plan's); transfers always need a hardware profile."""
    spec = hardware if hardware is not None else plan.hardware
    hw = hardware_mod.load(spec) if spec is not None else None
    if hw is None and costs is None:
        raise UserError("simulating a plan needs a hardware profile or a cost table")
    profile = analyze_plan(plan)
    if plan.offsets is not None:
        check_placement(profile, plan.offsets)
    n = len(plan.schedule)
    streams = _Streams(plan, profile, hw, source=costs if costs is not None else hw)
    start_t, end_t, compute_clock_at = [0.0] * n, [0.0] * n, [0.0] * n
    for i, step in enumerate(plan.schedule):
        if step.kind in RUNS:
            start, end = streams.run(i, step)
        elif step.kind in COPIES:
            start, end = streams.copy(i, step)
        else:  # free: no time, no stream
            start = end = streams.clock["compute"]
        start_t[i], end_t[i] = start, end
        compute_clock_at[i] = streams.clock["compute"]

    step_time = max(streams.clock.values())
    times, by_kind = _memory_timeline(profile, plan, start_t, end_t, compute_clock_at, step_time)
    return Simulation(step_time=step_time, compute_busy=streams.busy["compute"], stall=streams.stall,
                      stream_busy=streams.busy, traffic=streams.traffic, host_peak=_host_tiers(plan, hw),
                      events=streams.events, step_start=start_t, step_end=end_t,
                      memory_times=times, memory_by_kind=by_kind, profile=profile,
                      hardware=hw.name if hw else None,
                      cost_source="measured" if costs is not None else "roofline")


class _Streams:
    """The three streams (compute, d2h, h2d) as a schedule's steps are issued: each stream's
    clock, when each tensor's device copy is ready, and the host copies swapped out."""

    def __init__(self, plan: Plan, profile, hw, source):
        self.plan, self.hw, self.source = plan, hw, source
        graph, schedule = plan.graph, plan.schedule
        self.made_at = {(r.tensor, r.start): r for r in profile.residencies}
        self.roots = buffer_roots(profile) if plan.offsets is not None else {}
        self.current: dict[str, object] = {}     # tensor -> its open residency (to find its arena range)
        self.ready: dict[str, float] = {}        # tensor -> when its current device copy is complete
        self.host_copy: dict[str, tuple[str, float]] = {t: ("", 0.0) for t in plan.on_host}  # -> (tier, time)
        first = schedule[0] if schedule else None
        for r in profile.residencies:
            if r.start == 0 and r.index == 0 and not _made_by(first, graph, r.tensor):
                self.ready[r.tensor] = 0.0
                self.current[r.tensor] = r
        self.clock = {"compute": 0.0, "d2h": 0.0, "h2d": 0.0}
        self.busy = {"compute": 0.0, "d2h": 0.0, "h2d": 0.0}
        self.swapouts_done = 0.0                         # step rule: latest end of any earlier swap-out
        self.pending: list[tuple[int, int, float]] = []  # offsets rule: (lo, hi, end) of earlier swap-outs
        self.traffic: dict[str, dict[str, int]] = {}
        self.events: list[Event] = []
        self.stall = 0.0

    def alloc_wait(self, new) -> float:
        """When the storage of the residencies `new` is free to be written: after every earlier
        swap-out (no offsets), or after those whose arena range it overlaps."""
        new = [r for r in new if r.shares_with is None and r.nbytes > 0]
        if not new:
            return 0.0
        if self.plan.offsets is None:
            return self.swapouts_done
        wait = 0.0
        for r in new:
            lo = self.plan.offsets[r.key]
            hi = lo + r.nbytes
            for p_lo, p_hi, p_end in self.pending:
                if lo < p_hi and p_lo < hi:
                    wait = max(wait, p_end)
        return wait

    def run(self, i: int, step) -> tuple[float, float]:
        """A compute or recompute step on the compute stream: (start, end)."""
        graph, clock, ready = self.plan.graph, self.clock, self.ready
        op = graph.op_by_name[step.target]
        new = [self.made_at[(t, i)] for t in op.present_outputs]
        start = max([clock["compute"], self.alloc_wait(new)] + [ready[t] for t in op.present_inputs])
        end = start + op_time(op, graph, self.source)
        self.stall += start - clock["compute"]
        self.busy["compute"] += end - start
        clock["compute"] = end
        for r in new:
            ready[r.tensor] = end
            self.current[r.tensor] = r
        self.events.append(Event("compute", step.kind, step.target, i, start, end))
        return start, end

    def copy(self, i: int, step) -> tuple[float, float]:
        """A swap-out on the d2h stream or a swap-in on the h2d stream: (start, end)."""
        hw, clock = self.hw, self.clock
        if hw is None:
            raise UserError("the plan swaps tensors; simulating it needs a hardware profile")
        t, tier = step.target, step.tier or "dram"
        nbytes = self.plan.graph.tensors[t].nbytes
        flow = self.traffic.setdefault(tier, {"out": 0, "in": 0})
        if step.kind == StepKind.SWAP_OUT:
            stream = "d2h"
            start = max(self.ready[t], clock[stream])
            end = start + hw.transfer_time(nbytes, tier, stream)
            self.host_copy[t] = (tier, end)
            flow["out"] += nbytes
            if self.plan.offsets is None:
                self.swapouts_done = max(self.swapouts_done, end)
            else:
                lo = self.plan.offsets[self.roots[self.current[t].key]]
                self.pending = [p for p in self.pending if p[2] > clock["compute"]] + [(lo, lo + nbytes, end)]
        else:
            stream = "h2d"
            if t not in self.host_copy:
                raise ScheduleError(f"tensor '{t}' is swapped in at step {i} but has no copy on the host")
            home, copied = self.host_copy[t]
            if home and home != tier:
                raise ScheduleError(f"tensor '{t}' is swapped in from '{tier}' at step {i} but its host "
                                    f"copy is in '{home}'")
            self.host_copy[t] = (tier, copied)
            r = self.made_at[(t, i)]
            start = max(clock["compute"], clock[stream], copied, self.alloc_wait([r]))
            end = start + hw.transfer_time(nbytes, tier, stream)
            self.ready[t] = end
            self.current[t] = r
            flow["in"] += nbytes
        self.busy[stream] += end - start
        clock[stream] = end
        self.events.append(Event(stream, step.kind, t, i, start, end, nbytes, tier))
        return start, end


def _made_by(step, graph, tensor: str) -> bool:
    """Does `step` make `tensor` resident (compute of its producer, or a swap-in of it)?"""
    if step is None:
        return False
    if step.kind in RUNS:
        return tensor in graph.op_by_name[step.target].present_outputs
    return step.kind == StepKind.SWAP_IN and step.target == tensor


def _host_tiers(plan: Plan, hw: Hardware | None) -> dict[str, int]:
    """Peak bytes held in each host tier (step-indexed); raise ScheduleError past a capacity."""
    schedule, n = plan.schedule, len(plan.schedule)
    spans: dict[tuple[str, str], list[int]] = {}     # (tensor, tier) -> [first, last]
    for i, step in enumerate(schedule):
        if step.kind not in COPIES:
            continue
        key = (step.target, step.tier or "dram")
        if step.kind == StepKind.SWAP_OUT:
            spans.setdefault(key, [i, n - 1])[1] = n - 1
        else:
            span = spans.setdefault(key, [0, i])   # no swap-out first: it started on the host
            span[1] = i
    peaks: dict[str, int] = {}
    diffs: dict[str, np.ndarray] = {}
    for (tensor, tier), (first, last) in spans.items():
        d = diffs.setdefault(tier, np.zeros(n + 1, dtype=np.int64))
        d[first] += plan.graph.tensors[tensor].nbytes
        d[last + 1] -= plan.graph.tensors[tensor].nbytes
    for tier, d in diffs.items():
        held = np.cumsum(d)[:n]
        peaks[tier] = int(held.max())
        if hw is not None:
            capacity = hw.tier(tier).capacity
            if peaks[tier] > capacity:
                step = int(held.argmax())
                raise ScheduleError(f"the plan holds {peaks[tier]} bytes in host tier '{tier}' at step {step} "
                                    f"({schedule[step]}), over its capacity of {capacity} on '{hw.name}'")
    return peaks


def _memory_timeline(profile: MemoryProfile, plan: Plan, start_t, end_t, compute_clock_at,
                     step_time: float) -> tuple[list[float], dict[str, list[int]]]:
    """Residencies of the memory model placed on the simulated clock (see the module docstring)."""
    schedule, graph, n = plan.schedule, plan.graph, len(plan.schedule)
    deltas: list[tuple[float, int, str, int]] = []     # (time, 0 release / 1 alloc, kind, bytes)
    for r in profile.residencies:
        if r.nbytes == 0 or n == 0 or r.counted_from > r.end:
            continue
        if r.shares_with is not None:      # its bytes count once the buffer's earlier holders end
            alloc = end_t[r.counted_from - 1]
        elif _made_by(schedule[r.start], graph, r.tensor):
            alloc = start_t[r.start]
        else:
            alloc = 0.0
        last = schedule[r.end]
        if r.end == n - 1:
            release = step_time
        elif last.kind in RUNS or last.target == r.tensor:
            release = end_t[r.end]
        else:
            release = compute_clock_at[r.end]
        if release <= alloc:
            continue
        deltas.append((alloc, 1, r.kind, r.nbytes))
        deltas.append((release, 0, r.kind, -r.nbytes))
    deltas.sort(key=lambda d: (d[0], d[1]))
    kinds = sorted({d[2] for d in deltas})
    level = dict.fromkeys(kinds, 0)
    times: list[float] = []
    by_kind: dict[str, list[int]] = {k: [] for k in kinds}
    for time, _, kind, delta in deltas:
        level[kind] += delta
        if times and times[-1] == time:
            for k in kinds:
                by_kind[k][-1] = level[k]
        else:
            times.append(time)
            for k in kinds:
                by_kind[k].append(level[k])
    return times, by_kind
