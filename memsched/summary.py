"""What `memsched inspect` reports about a graph: ops, tensors, parameters, default-order peak."""
from __future__ import annotations

from collections import Counter

from .ir import Graph
from .memory import analyze
from .schedule import default_schedule


def inspect_graph(graph: Graph, top: int = 10) -> dict:
    """A JSON-able summary (docs/json.md keys: ops, tensors, parameter_bytes, peak_bytes)."""
    profile = analyze(graph, default_schedule(graph))
    step = profile.peak_step
    params = graph.parameters()
    largest = sorted(graph.tensors.values(), key=lambda t: (-t.nbytes, t.name))[:top]
    return {
        "graph": graph.name,
        "ops": len(graph.ops),
        "op_types": dict(sorted(Counter(op.op_type for op in graph.ops).items(), key=lambda kv: (-kv[1], kv[0]))),
        "tensors": len(graph.tensors),
        "inputs": {n: list(graph.tensors[n].shape) for n in graph.inputs},
        "outputs": {n: list(graph.tensors[n].shape) for n in graph.outputs},
        "parameters": sum(t.numel for t in params),
        "parameter_bytes": sum(t.nbytes for t in params),
        "peak_bytes": profile.peak_bytes,
        "peak_step": step,
        "peak_op": graph.ops[step].name if graph.ops else None,
        "peak_by_kind": profile.kinds_at(step) if graph.ops else {},
        "largest_tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype_name,
                             "kind": t.kind, "bytes": t.nbytes} for t in largest],
    }


def predicted_step_time(plan, device: str, hardware: str | None = None) -> tuple[float | None, str | None]:
    """The simulator's step time for the device a run used, and the profile behind it:
    `hardware` (a preset or profile file, e.g. one `memsched hardware calibrate` wrote on this
    machine) where given, else the measured `cpu` profile on CPU and the plan's own hardware on
    CUDA (None where it has none)."""
    from .hardware import load
    from .simulate import simulate

    spec = hardware or ("cpu" if device == "cpu" else plan.hardware)
    if spec is None:
        return None, None
    hardware = load(spec)
    return simulate(plan, hardware).step_time, hardware.name


def run_summary(result, path: str | None = None, predicted: tuple[float | None, str | None] = (None, None)) -> dict:
    """What `memsched run` reports (docs/json.md keys: provider, steps, measured, predicted, check).

    `predicted` holds the memory model's bytes and the simulator's step time (and profile)
    from `predicted_step_time`, for the device that really ran."""
    return {
        "plan": path,
        "provider": result.provider,
        "providers": result.providers,
        "requested_device": result.requested_device,
        "fallback": result.fallback,
        "steps": result.steps,
        "measured": {"arena_bytes": result.arena_bytes, "peak_bytes": result.peak_bytes,
                     "step_time_s": result.step_time_s},
        "predicted": {"arena_bytes": result.planned_arena_bytes, "peak_bytes": result.planned_peak_bytes,
                      "step_time_s": predicted[0], "hardware": predicted[1]},
        "check": result.check,
        "ops": result.ops,
        "sessions": result.sessions,
        "swapped_bytes": result.swapped_bytes,
        "step_times_s": result.step_times,
    }
