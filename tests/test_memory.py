"""The memory model is exact: hand-worked byte counts at every step, and properties on random DAGs."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto

from memsched.errors import ScheduleError
from memsched.ir import Graph, Op, Tensor
from memsched.memory import analyze, buffers, check_placement, validate
from memsched.schedule import Plan, compute, default_schedule, free, recompute, swap_in, swap_out

F = TensorProto.FLOAT


def t(name, n, kind="activation", static=False):
    """A float tensor of n elements (4n bytes)."""
    return Tensor(name, (n,), F, kind, TensorProto(name=name) if static else None)


def chain_graph():
    """x(10) -a-> p(20) -b-> q(30) -c-> y(5), with a parameter w(100) read by b."""
    tensors = {x.name: x for x in [t("x", 10, "input"), t("p", 20), t("q", 30), t("y", 5, "output"),
                                   t("w", 100, "parameter", True)]}
    ops = [Op("a", "Relu", ["x"], ["p"]), Op("b", "Mul", ["p", "w"], ["q"]), Op("c", "Relu", ["q"], ["y"])]
    return Graph(ops, tensors, ["x"], ["y"])



def test_default_schedule_exact_bytes_per_step():
    g = chain_graph()
    prof = analyze(g, default_schedule(g))
    # step 0 (a): x 40 + p 80 + w 400; step 1 (b): p 80 + q 120 + w 400; step 2 (c): q 120 + y 20 + w 400
    assert prof.live_bytes.tolist() == [520, 600, 540]
    assert prof.peak_bytes == 600 and prof.peak_step == 1
    assert prof.kinds_at(1) == {"activation": 200, "parameter": 400}
    assert prof.kinds_at(2) == {"activation": 120, "output": 20, "parameter": 400}


def test_the_same_plan_of_the_same_graph_is_analysed_once():
    """A compile judges one plan several times: the profile is kept, by schedule, aliases and
    host tensors, and cannot be changed by whoever holds it."""
    g = chain_graph()
    schedule = default_schedule(g)
    first = analyze(g, schedule)
    assert analyze(g, list(schedule)) is first                    # an equal schedule, not the same list
    with pytest.raises(ValueError):
        first.live_bytes[0] = 0
    swapped = analyze(g, [compute("a"), swap_out("p"), swap_in("p"), compute("b"), compute("c")])
    assert swapped is not first and swapped.live_bytes.tolist() != first.live_bytes.tolist()
    hosted = [compute("a"), swap_in("w"), compute("b"), compute("c")]
    assert analyze(g, hosted, on_host={"w"}).live_bytes[0] == first.live_bytes[0] - 400   # w starts on the host
    assert analyze(chain_graph(), schedule) is not first           # another graph, its own profiles


def test_swap_and_recompute_residencies():
    g = chain_graph()
    sched = [compute("a"), swap_out("p"), swap_in("p"), compute("b"), compute("c")]
    prof = analyze(g, sched)
    # p leaves after its swap-out step and comes back at the swap-in step
    assert prof.live_bytes.tolist() == [520, 480, 480, 600, 540]
    assert [(r.tensor, r.index, r.start, r.end) for r in prof.residencies if r.tensor == "p"] == \
        [("p", 0, 0, 1), ("p", 1, 2, 3)]
    sched = [compute("a"), compute("b"), recompute("b"), compute("c")]
    prof = analyze(g, sched)  # q recomputed: the first copy dies at its last use (none after step 1)
    assert [(r.start, r.end) for r in prof.residencies if r.tensor == "q"] == [(1, 1), (2, 3)]


def test_invalid_schedules_name_the_tensor():
    g = chain_graph()
    with pytest.raises(ScheduleError, match="'p'.*not resident"):
        analyze(g, [compute("a"), free("p"), compute("b"), compute("c")])
    with pytest.raises(ScheduleError, match="'q'.*before it is produced"):
        analyze(g, [compute("a"), compute("c"), compute("b")])
    with pytest.raises(ScheduleError, match="computed twice"):
        analyze(g, [compute("a"), compute("a")])
    with pytest.raises(ScheduleError, match="'p'.*not resident"):
        analyze(g, [compute("a"), swap_out("p"), compute("b")])


def test_explicit_free_extends_nothing_and_budget_is_enforced():
    g = chain_graph()
    prof = analyze(g, [compute("a"), compute("b"), free("p"), compute("c")])
    assert prof.live_bytes.tolist() == [520, 600, 520, 540]
    with pytest.raises(ScheduleError, match="over its budget of 599"):
        validate(Plan(g, default_schedule(g), budget=599))
    validate(Plan(g, default_schedule(g), budget=600))


def test_inplace_alias_counts_storage_once():
    g = Graph([Op("a", "Relu", ["x"], ["p"]), Op("b", "Relu", ["p"], ["q"]), Op("c", "Identity", ["q"], ["y"])],
              {"x": t("x", 10, "input"), "p": t("p", 10), "q": t("q", 10), "y": t("y", 10, "output")},
              ["x"], ["y"])
    plain = analyze(g, default_schedule(g))
    assert plain.live_bytes.tolist() == [80, 80, 80]
    aliased = analyze(g, default_schedule(g), aliases={"q": "p"})
    assert aliased.live_bytes.tolist() == [80, 40, 80]
    keys = {k: (s, e) for k, s, e, _ in buffers(aliased)}
    assert keys[("p", 0)] == (0, 2)  # p and q share one buffer from a through c
    with pytest.raises(ScheduleError, match="may not alias 'x'"):
        analyze(g, default_schedule(g), aliases={"p": "x"})  # graph inputs are never overwritten


def test_a_fused_gemm_update_writes_in_place_only_over_its_parameter():
    # w' = w - lr * (a^T b) as one Gemm (passes.reuse.fuse_updates): its output may take
    # w's storage (C), never a or b's, which the product reads while it writes
    g = Graph([Op("fa", "Relu", ["x"], ["a"]), Op("fb", "Relu", ["x"], ["b"]),
               Op("upd", "Gemm", ["a", "b", "w"], ["w.updated"], {"alpha": -0.1, "beta": 1.0, "transA": 1},
                  phase="update")],
              {"x": t("x", 4, "input"), "a": t("a", 4), "b": t("b", 4), "w": t("w", 4, "parameter", True),
               "w.updated": t("w.updated", 4, "output")}, ["x"], ["w.updated"])
    g.tensors["a"].shape = g.tensors["b"].shape = g.tensors["w"].shape = g.tensors["w.updated"].shape = (2, 2)
    # at the update a 16 + b 16 + w 16, and w.updated 16 of its own unless it takes w's storage
    assert analyze(g, default_schedule(g)).live_bytes.tolist() == [48, 64, 64]
    assert analyze(g, default_schedule(g), aliases={"w.updated": "w"}).live_bytes.tolist() == [48, 64, 48]
    for source in ("a", "b"):
        with pytest.raises(ScheduleError, match=f"may not alias '{source}': a Gemm update writes in place only"):
            analyze(g, default_schedule(g), aliases={"w.updated": source})


def test_alias_rejected_when_source_still_used():
    g = Graph([Op("a", "Relu", ["x"], ["p"]), Op("b", "Relu", ["p"], ["q"]), Op("c", "Add", ["p", "q"], ["y"])],
              {"x": t("x", 10, "input"), "p": t("p", 10), "q": t("q", 10), "y": t("y", 10, "output")},
              ["x"], ["y"])
    with pytest.raises(ScheduleError, match="'p' is still used after step 1"):
        analyze(g, default_schedule(g), aliases={"q": "p"})


def test_a_view_shares_its_inputs_storage_while_both_are_read():
    """Rule 4: a Reshape shares its input's buffer even where the input is read later (as
    ONNX Runtime's aliasing kernels do); the buffer counts once, until its last reader."""
    g = Graph([Op("a", "Relu", ["x"], ["p"]), Op("v", "Reshape", ["p", "shape"], ["r"]),
               Op("b", "Relu", ["p"], ["q"]), Op("c", "Add", ["r", "q"], ["y"])],
              {"x": t("x", 10, "input"), "shape": Tensor("shape", (1,), TensorProto.INT64, "input"),
               "p": t("p", 10), "r": t("r", 10), "q": t("q", 10), "y": t("y", 10, "output")},
              ["x", "shape"], ["y"])
    copied = analyze(g, default_schedule(g))
    assert copied.live_bytes.tolist() == [88, 88, 120, 120]
    shared = analyze(g, default_schedule(g), aliases={"r": "p"})
    assert shared.live_bytes.tolist() == [88, 48, 80, 120]      # p and r: one 40-byte buffer
    first = {r.tensor: r.counted_from for r in shared.residencies}
    assert (first["p"], first["r"]) == (0, 3)                   # r counts once p's reads are over
    assert {k: (s, e) for k, s, e, _ in buffers(shared)}[("p", 0)] == (0, 3)
    # an op that writes over p may not, while the view of it is still to be read
    with pytest.raises(ScheduleError, match="'q' may not overwrite 'p' in place at step 2: 'r' shares"):
        analyze(g, default_schedule(g), aliases={"r": "p", "q": "p"})


def test_scatter_runs_in_place_over_its_data_input_only():
    """ScatterND/ScatterElements write over their data (input 0), as ONNX Runtime's kernels
    may; never over their updates, even where the sizes agree."""
    g = Graph([Op("z", "Relu", ["x"], ["data"]), Op("u", "Relu", ["x"], ["upd"]),
               Op("s", "ScatterElements", ["data", "idx", "upd"], ["y"], {"axis": 0})],
              {"x": t("x", 10, "input"), "data": t("data", 10), "upd": t("upd", 10),
               "idx": Tensor("idx", (10,), TensorProto.INT64, "input"), "y": t("y", 10, "output")},
              ["x", "idx"], ["y"])
    plain = analyze(g, default_schedule(g))
    assert plain.live_bytes.tolist() == [160, 200, 200]  # x 40 until u; idx 80 throughout
    assert analyze(g, default_schedule(g), aliases={"y": "data"}).live_bytes.tolist() == [160, 200, 160]
    with pytest.raises(ScheduleError, match="only over its first input"):
        analyze(g, default_schedule(g), aliases={"y": "upd"})


def test_update_overwrites_parameter_in_place():
    g = Graph([Op("upd", "Sub", ["w", "g"], ["w.updated"], phase="update")],
              {"w": t("w", 100, "parameter", True), "g": t("g", 100, "input"),
               "w.updated": t("w.updated", 100, "output")}, ["g"], ["w.updated"])
    assert analyze(g, default_schedule(g)).peak_bytes == 1200
    assert analyze(g, default_schedule(g), aliases={"w.updated": "w"}).peak_bytes == 800


def test_placement_check_catches_overlap():
    g = chain_graph()
    prof = analyze(g, default_schedule(g))
    good = {("x", 0): 0, ("p", 0): 40, ("q", 0): 120, ("y", 0): 0, ("w", 0): 240}
    assert check_placement(prof, good) == 640
    bad = {**good, ("q", 0): 100}  # q [100,220) overlaps p [40,120) at step 1
    with pytest.raises(ScheduleError, match="overlap"):
        check_placement(prof, bad)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 6), st.integers(0, 40), st.integers(0, 24)),
                min_size=1, max_size=14))
def test_placement_check_agrees_with_every_pair(spans):
    """The sweep (live ranges kept sorted, only a new range's neighbours compared) finds an
    overlap exactly where some pair of buffers live at a common step overlaps in bytes."""
    from memsched.memory import MemoryProfile, Residency

    residencies = [Residency(f"t{i}", 0, first, first + length, nbytes, "activation", None, first)
                   for i, (first, length, _, nbytes) in enumerate(spans)]
    offsets = {r.key: lo for r, (_, _, lo, _) in zip(residencies, spans)}
    profile = MemoryProfile(residencies, np.zeros(1, dtype=np.int64), {}, [])
    clash = any(a.nbytes and b.nbytes and a.start <= b.end and b.start <= a.end
                and offsets[a.key] < offsets[b.key] + b.nbytes and offsets[b.key] < offsets[a.key] + a.nbytes
                for i, a in enumerate(residencies) for b in residencies[i + 1:])
    if clash:
        with pytest.raises(ScheduleError, match="overlap"):
            check_placement(profile, offsets)
    else:
        assert check_placement(profile, offsets) == max((offsets[r.key] + r.nbytes for r in residencies
                                                          if r.nbytes), default=0)


@st.composite
def random_dags(draw):
    """A random DAG of unary/binary ops over random-size tensors, in a valid stored order."""
    n = draw(st.integers(1, 14))
    sizes = draw(st.lists(st.integers(1, 50), min_size=n + 1, max_size=n + 1))
    tensors = {"in": t("in", sizes[0], "input")}
    ops = []
    for i in range(n):
        k = draw(st.integers(1, min(2, len(tensors))))
        srcs = draw(st.lists(st.sampled_from(list(tensors)), min_size=k, max_size=k, unique=True))
        name = f"t{i}"
        tensors[name] = t(name, sizes[i + 1])
        ops.append(Op(f"op{i}", "Add" if k == 2 else "Relu", srcs, [name]))
    used = {x for op in ops for x in op.inputs}
    outputs = [name for name in tensors if name not in used and name != "in"] or [f"t{n - 1}"]
    for name in outputs:
        tensors[name].kind = "output"
    return Graph(ops, tensors, ["in"], outputs)


@settings(max_examples=200, deadline=None)
@given(random_dags())
def test_peak_bounds_on_random_dags(g):
    prof = analyze(g, default_schedule(g))
    largest_op = max(sum(g.tensors[x].nbytes for x in set(op.inputs + op.outputs)) for op in g.ops)
    assert largest_op <= prof.peak_bytes <= sum(x.nbytes for x in g.tensors.values())
    # every step's bytes equal the residencies covering it, recomputed plainly
    for step in range(len(g.ops)):
        assert prof.live_bytes[step] == sum(r.nbytes for r in prof.residencies if r.start <= step <= r.end)
    assert np.all(prof.live_bytes >= 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 4), st.booleans(), st.booleans()),
                min_size=2, max_size=8))
def test_the_in_place_writer_check_agrees_with_its_definition(members):
    """Rule 4's last clause, checked in O(M log M) per buffer, refuses exactly the plans the
    definition does: a writer at step s clashes with any other member of its buffer that
    started by s and is read (or held) past s."""
    from memsched.memory import Residency, _check_writers_own_buffers
    residencies = [Residency(f"t{i}", 0, start, start + length, 4, "activation")
                   for i, (start, length, _, _) in enumerate(members)]
    events = [(r.key, (f"in{i}",), r.start, False) for i, (r, m) in enumerate(zip(residencies, members)) if m[2]]
    held = {r.key for r, m in zip(residencies, members) if m[3]}
    clash = any(other is not r and other.start <= r.start < other.end + (other.key in held)
                for r, m in zip(residencies, members) if m[2] for other in residencies)
    try:
        _check_writers_own_buffers({residencies[0].key: residencies}, events, held)
        refused = False
    except ScheduleError:
        refused = True
    assert refused == clash


def test_a_long_in_place_chain_is_one_buffer_in_any_order():
    from memsched.memory import Residency, _groups
    chain = [Residency("x", 0, 0, 1, 4, "activation")] + [
        Residency(f"c{i}", 0, i, i + 1, 4, "activation", (f"c{i - 1}", 0) if i else ("x", 0)) for i in range(3000)]
    groups = _groups(chain[::-1])
    assert list(groups) == [("x", 0)] and len(groups[("x", 0)]) == 3001
