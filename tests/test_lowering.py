"""Lowering a plan to a program without ONNX Runtime: what each step binds, where segments
are cut, and how swap copies run, on a stand-in for the device side."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from memsched.memory import analyze_plan, buffer_roots
from memsched.runtime.program import Copy, Hooks, Run, Segment, lower
from tests.planbuild import mlp_train_graph, recompute_plan, swap_plan

MLP = mlp_train_graph()
BASE = 1 << 20          # the stand-in arena's address: stores are placed after it


def stand_in(device: str):
    """What `lower` reads of the device side: its device, the arena's address, the values read
    from host arrays, and stores for the host tiers (here plain host buffers, kept in `made`)."""
    made: dict = {}

    def stores(sizes):
        made.update({key: np.zeros(n, np.uint8) for key, n in sizes.items()})
        return made

    return SimpleNamespace(device=device, base=BASE, host_values={}, stores=stores, made=made)


@pytest.fixture(autouse=True)
def no_onnx_runtime(monkeypatch):
    """Lowering makes no session: any attempt fails the test."""
    import onnxruntime

    def refuse(*args, **kwargs):
        raise AssertionError("lowering made an ONNX Runtime session")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)


def test_every_step_binds_its_planned_bytes():
    plan = recompute_plan(MLP)
    profile = analyze_plan(plan)
    program = lower(plan, profile, stand_in("cpu"), Hooks({}, {}))
    roots = buffer_roots(profile)
    for r in profile.residencies:
        lo, hi = program.regions[r.key]
        assert lo == (plan.offsets.get(roots[r.key], 0) if r.nbytes else 0) and hi - lo == r.nbytes
    runs = [a for a in program.actions if isinstance(a, Run)]
    assert [a.op.name for a in runs] == [s.target for s in plan.schedule if s.kind in ("compute", "recompute")]
    for run in runs:
        assert [t for t, _, _ in run.reads] == [t for t in run.op.inputs if t]
        assert all(hi - lo == MLP.tensors[t].nbytes for t, lo, hi in run.reads)
    recomputed = [a for a, s in zip(program.actions, plan.schedule) if s.kind == "recompute"]
    assert recomputed and all(isinstance(a, Run) for a in recomputed)


def test_a_swap_is_a_node_of_its_segment_on_the_cpu_and_an_item_of_its_own_on_cuda():
    plan = swap_plan(MLP)
    profile = analyze_plan(plan)
    swaps = sum(s.kind in ("swap_out", "swap_in") for s in plan.schedule)
    assert swaps
    cpu = stand_in("cpu")
    on_cpu = lower(plan, profile, cpu, Hooks({}, {}))
    assert not any(isinstance(item, Copy) for item in on_cpu.items)
    copies = [run for item in on_cpu.items if isinstance(item, Segment) for run in item.runs
              if run.op.op_type == "Identity" and "/" in run.op.name]
    assert len(copies) == swaps                       # each copy an Identity between the arena and a store
    stores = {store.ctypes.data - BASE for store in cpu.made.values()}   # bound as offsets from the arena
    for run in copies:
        (tensor, lo, hi), (_, out_lo, out_hi, _) = run.reads[0], run.writes[0]
        outside = out_lo if run.op.name.startswith("swap_out") else lo
        assert outside in stores and hi - lo == out_hi - out_lo == MLP.tensors[tensor].nbytes
    on_cuda = lower(plan, profile, stand_in("cuda"), Hooks({}, {}))
    assert sum(isinstance(item, Copy) for item in on_cuda.items) == swaps
    segments = [item for item in on_cuda.items if isinstance(item, Segment)]
    assert all(not run.waits for s in segments for run in s.runs[1:])   # a run that waits for a copy
    assert any(s.runs[0].waits for s in segments)                        # starts a segment
    assert on_cuda.swapped_bytes == on_cpu.swapped_bytes and sum(on_cpu.swapped_bytes.values()) > 0


def test_hooks_cut_segments_around_their_steps():
    plan = recompute_plan(MLP)
    profile = analyze_plan(plan)
    whole = lower(plan, profile, stand_in("cpu"), Hooks({}, {}))
    step = next(i for i, a in enumerate(whole.actions) if isinstance(a, Run) and i > 2)
    cut = lower(plan, profile, stand_in("cpu"), Hooks({step: print}, {step: print}))
    segments = [item for item in cut.items if isinstance(item, Segment)]
    alone = [s for s in segments if step in s.steps]
    assert len(alone) == 1 and alone[0].steps == {step}
    assert len(segments) > len([item for item in whole.items if isinstance(item, Segment)])
