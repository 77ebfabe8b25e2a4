"""The executor: real runs of plans, bit-identical to a plain ONNX Runtime run, with measured
memory equal to the memory model's, and wrong plans stopped before anything runs."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto as TP
from onnx import helper

from memsched import ort, simulate
from memsched.emit import read_plan, write_plan
from memsched.errors import ScheduleError, UserError
from memsched.runtime import device, program, run, run_plan
from memsched.memory import analyze_plan, check_placement
from memsched.schedule import Plan, default_schedule, free, recompute, swap_out
from tests.planbuild import (SMALL_MODELS, all_plans, cnn_graph, edit_plan_metadata, lower_graph, mlp_train_graph,
                             order_plan, place, small_model, strategy_plans, training_graph, with_recomputes,
                             with_step_inserted, with_swaps)

MLP = mlp_train_graph()
PLANS = {**{f"mlp-{k}": v for k, v in all_plans(MLP).items()}, "cnn-order": order_plan(cnn_graph())}


def _assert_measured_equals_planned(result, plan):
    profile = analyze_plan(plan)
    assert np.array_equal(result.live_bytes, profile.live_bytes)
    assert result.peak_bytes == result.planned_peak_bytes == profile.peak_bytes
    assert result.arena_bytes == result.arena_high_water == check_placement(profile, plan.offsets)


@pytest.mark.parametrize("name", sorted(PLANS))
def test_checked_run_is_bit_identical_and_measures_the_planned_memory(name):
    plan = PLANS[name]
    result = run_plan(plan, check=True)
    assert result.check["passed"] and result.check["bit_identical"]
    assert result.check["max_abs_diff"] == 0.0
    assert set(result.check["per_output"]) == set(plan.graph.outputs)
    _assert_measured_equals_planned(result, plan)
    assert result.provider == "CPUExecutionProvider" and result.fallback is None
    assert result.ops == sum(s.kind in ("compute", "recompute") for s in plan.schedule)
    assert result.providers == {"CPUExecutionProvider": result.ops}
    assert result.step_time_s > 0


@pytest.mark.parametrize("strategy", [with_recomputes, with_swaps])
def test_generic_recompute_and_swap_plans(strategy):
    plan = strategy(PLANS["mlp-reuse"], every=1)
    kinds = {s.kind for s in plan.schedule}
    assert kinds & {"recompute", "swap_out"}, "the builder found nothing to replay or swap"
    result = run_plan(plan, check=True, steps=2)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    _assert_measured_equals_planned(result, plan)


def test_swaps_go_to_their_tiers_and_nvdimm_dir_is_used(tmp_path):
    plan = PLANS["mlp-swap"]
    result = run_plan(plan, check=True, nvdimm_dir=str(tmp_path))
    assert result.check["passed"]
    nbytes = MLP.tensors
    assert result.swapped_bytes == {"dram": nbytes["a"].nbytes, "nvdimm": nbytes["W1"].nbytes}
    assert list(tmp_path.iterdir()) == []      # the store file is gone after the run


def test_outputs_swapped_out_at_the_end_are_read_from_their_tier():
    plan = PLANS["mlp-reuse"]
    after = {s.target: i for i, s in enumerate(plan.schedule)}
    schedule = list(plan.schedule)
    for name, tier in (("W1.update", "nvdimm"), ("mean", "dram")):   # producers of W1.updated and loss
        schedule.insert(schedule.index(plan.schedule[after[name]]) + 1,
                        swap_out("W1.updated" if name == "W1.update" else "loss", tier))
    swapped = place(dataclasses.replace(plan, schedule=schedule))
    result = run_plan(swapped, check=True, steps=2)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    _assert_measured_equals_planned(result, swapped)
    assert result.swapped_bytes == {"nvdimm": MLP.tensors["W1"].nbytes, "dram": 4}


def test_multi_step_training_feeds_updates_back_and_stays_identical():
    steps, seen = 4, []
    one = run_plan(PLANS["mlp-reuse"], steps=1)
    result = run_plan(PLANS["mlp-reuse"], steps=steps, check=True, progress=lambda k, n: seen.append((k, n)))
    assert result.check["passed"] and result.check["steps"] == steps
    assert seen == [(k, steps) for k in range(1, steps + 1)]
    assert len(result.step_times) == steps
    # the hand-written gradient is right, so SGD lowers the loss on a fixed batch
    assert float(result.outputs["loss"]) < float(one.outputs["loss"])


def test_given_inputs_are_used_and_checked():
    x = np.full((4, 6), 0.5, np.float32)
    a = run_plan(PLANS["mlp-order"], inputs={"x": x}, check=True)
    b = run_plan(PLANS["mlp-order"])
    assert a.check["passed"] and float(a.outputs["loss"]) != float(b.outputs["loss"])
    with pytest.raises(UserError, match="input 'x' must be float32 of shape \\(4, 6\\)"):
        run_plan(PLANS["mlp-order"], inputs={"x": x[:2]})
    with pytest.raises(UserError, match="no input named 'z'"):
        run_plan(PLANS["mlp-order"], inputs={"z": x})


def test_two_threads_are_still_bit_identical():
    result = run_plan(PLANS["cnn-order"], check=True, threads=2)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0


def _fp16_chain():
    """Ops with no float16 CPU kernel in a row (ORT runs them in float32 between Casts)."""
    nodes = [helper.make_node("Sin", ["x"], ["a"], name="sin1"), helper.make_node("Exp", ["a"], ["b"], name="exp"),
             helper.make_node("Sin", ["b"], ["c"], name="sin2"), helper.make_node("Mul", ["c", "x"], ["y"], name="mul")]
    return lower_graph(nodes, [helper.make_tensor_value_info("x", TP.FLOAT16, [64])],
                  [helper.make_tensor_value_info("y", TP.FLOAT16, [64])], [], "fp16")


def test_float16_is_bit_identical_though_a_plain_whole_graph_run_keeps_float32():
    graph = _fp16_chain()
    result = run_plan(order_plan(graph), check=True)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    # why the reference routes float16 tensors through barriers: without them ORT keeps the
    # intermediates in float32 and the whole-graph result differs from the declared graph
    x = run.prepare_inputs(graph)["x"]
    plain = onnxruntime.InferenceSession(graph.to_onnx().SerializeToString(), ort.session_options(1),
                                         providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert not np.array_equal(plain, result.outputs["y"])


@pytest.mark.skipif(ort.resolve_device("cuda")[0] == "cuda", reason="a usable GPU is present")
def test_cuda_request_without_a_gpu_runs_on_cpu_and_says_so():
    result = run_plan(PLANS["mlp-order"], device="cuda", check=True)
    assert result.provider == "CPUExecutionProvider" and result.requested_device == "cuda"
    assert result.fallback and result.check["passed"]


# ---- the bundled networks -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SMALL_MODELS))
def test_every_network_forward_runs_bit_identical(name):
    plan = order_plan(small_model(name))
    result = run_plan(plan, check=True)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    _assert_measured_equals_planned(result, plan)
    assert result.sessions < result.ops or result.ops < 10   # equal ops share sessions


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
def test_float16_networks_run_bit_identical(name):
    plan = order_plan(small_model(name, dtype="float16"))
    result = run_plan(plan, check=True)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0


# 6-60 s each on 2 cores
SLOW_TRAINING = {"vgg16", "resnet18", "resnet50", "mobilenetv2", "bert-base", "unet3d", "gpt2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TRAINING else n
                                  for n in sorted(SMALL_MODELS)])
def test_every_training_step_and_strategy_runs_bit_identical(name):
    """order; + reuse; + recompute; + swap on the network's SGD training step, two steps each
    (the second runs on the first's updated weights)."""
    plans = strategy_plans(training_graph(name))
    assert any(s.kind == "recompute" for s in plans["recompute"].schedule)
    assert any(s.kind == "swap_out" for s in plans["swap"].schedule)
    for label, plan in plans.items():
        result = run_plan(plan, check=True, steps=2)
        assert result.check["passed"] and result.check["max_abs_diff"] == 0.0, label
        _assert_measured_equals_planned(result, plan)


@pytest.mark.slow
def test_adam_training_step_runs_bit_identical():
    plan = strategy_plans(training_graph("gpt2", optimizer="adam"))["swap"]
    result = run_plan(plan, check=True, steps=3)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    _assert_measured_equals_planned(result, plan)


def test_batch_norm_in_training_mode_runs_bit_identical():
    plan = order_plan(small_model("unet2d", bn_training=True))
    result = run_plan(plan, check=True, steps=2)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0


# ---- wrong plans are stopped before anything runs ------------------------------------------
@pytest.fixture
def no_sessions(monkeypatch):
    """Any ONNX Runtime session built from here on fails the test (ONNX Runtime's own
    once-per-process warm-up aside, done first so the test does not depend on test order)."""
    ort.warm_environment()

    def refuse(*args, **kwargs):
        raise AssertionError("a session was built for a plan that should have been rejected")
    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)


def _early_free(plan):
    index = next(i for i, s in enumerate(plan.schedule) if s.target == "mm2")
    return with_step_inserted(plan, index + 1, free("r"))


@pytest.mark.parametrize("wrong, error, message", [
    (_early_free, ScheduleError, "tensor 'r' is read by op 'rT'"),
    (lambda p: dataclasses.replace(p, budget=analyze_plan(p).peak_bytes - 1), ScheduleError, "over its budget"),
    (lambda p: dataclasses.replace(p, offsets={**p.offsets, ("a", 0): p.offsets[("h", 0)]}), ScheduleError,
     "tensors '(a|h)' and '(a|h)' are live together"),
    (lambda p: dataclasses.replace(p, offsets={**p.offsets, ("a", 0): p.offsets[("a", 0)] + 10_002}), ScheduleError,
     "tensor 'a' is placed at arena offset .* not a multiple of its element size 4"),
    (lambda p: dataclasses.replace(p, offsets=None), UserError, "no arena offsets"),
    (lambda p: dataclasses.replace(p, schedule=p.schedule + [free("loss")]), ScheduleError,
     "graph output 'loss' is freed before the end"),
])
def test_wrong_plan_fails_before_running(no_sessions, wrong, error, message):
    plan = PLANS["mlp-order"]
    if wrong is _early_free:
        plan = _early_free(plan)
    else:
        plan = wrong(plan)
    with pytest.raises(error, match=message):
        run_plan(plan)


def test_swap_in_from_a_tier_it_was_not_swapped_to(no_sessions):
    plan = PLANS["mlp-swap"]
    schedule = [dataclasses.replace(s, tier="nvdimm") if s.kind == "swap_in" and s.target == "a" else s
                for s in plan.schedule]
    with pytest.raises(ScheduleError, match="tensor 'a' is swapped in from nvdimm .* no copy of it was put there"):
        run_plan(dataclasses.replace(plan, schedule=schedule))


def test_hand_edited_emitted_plan_is_caught_naming_the_tensor(tmp_path, no_sessions):
    path = write_plan(PLANS["mlp-recompute"], tmp_path / "scheduled.onnx")

    def free_too_early(doc):   # free the replayed r before rT reads it
        at = [s[0:2] for s in doc["schedule"]].index(["recompute", "relu"])
        doc["schedule"].insert(at + 1, ["free", "r", None, "compute"])

    edit_plan_metadata(path, free_too_early, reseal=True)
    with pytest.raises(ScheduleError, match="tensor 'r' is read by op 'rT'"):
        run_plan(read_plan(path))


def test_recomputing_a_random_op_is_refused():
    node = helper.make_node("RandomNormalLike", ["x"], ["noise"], name="noise", seed=1.0)
    add = helper.make_node("Add", ["x", "noise"], ["y"], name="add")
    mul = helper.make_node("Mul", ["y", "noise"], ["z"], name="mul")
    graph = lower_graph([node, add, mul], [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                   [helper.make_tensor_value_info("z", TP.FLOAT, [3])], [], "random")
    plan = place(Plan(graph, [*default_schedule(graph)[:2], recompute("noise"), default_schedule(graph)[2]]))
    with pytest.raises(ScheduleError, match="op 'noise' \\(RandomNormalLike\\) draws random numbers"):
        run_plan(plan)


def test_bad_options():
    with pytest.raises(UserError, match="--steps must be at least 1"):
        run_plan(PLANS["mlp-order"], steps=0)
    with pytest.raises(UserError, match="unknown device 'tpu'"):
        run_plan(PLANS["mlp-order"], device="tpu")
    with pytest.raises(UserError, match="cannot create the NVDIMM store"):
        run_plan(PLANS["mlp-swap"], nvdimm_dir="/nonexistent/memsched")


@pytest.mark.parametrize("given_dir", [True, False])
def test_an_nvdimm_store_on_a_full_filesystem_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, given_dir):
    """The store's blocks are reserved before it is mapped: a mapped sparse file past the free
    space ends the process with SIGBUS at its first write."""
    import errno
    import tempfile

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("memsched.runtime.device.os.posix_fallocate", full)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # where a store folder of its own goes
    store = tmp_path / "store"
    store.mkdir()
    with pytest.raises(UserError, match=r"cannot reserve [0-9,]+ bytes for the NVDIMM store in .*: No space left"):
        run_plan(PLANS["mlp-swap"], nvdimm_dir=str(store) if given_dir else None)
    assert list(store.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["store"]


# ---- the check can fail -------------------------------------------------------------------
def _clobbered(plan):
    """`plan` with a later tensor placed on `a`'s bytes while `a` is still needed."""
    profile = analyze_plan(plan)
    a = next(r for r in profile.residencies if r.tensor == "a")
    later = next(r for r in profile.residencies if a.start + 3 < r.start < a.end and r.nbytes == a.nbytes)
    return dataclasses.replace(plan, offsets={**plan.offsets, later.key: plan.offsets[a.key]})


@pytest.fixture
def judges_bypassed(monkeypatch):
    """The memory model and the rehearsal accept anything; the arena keeps the real size."""
    arena = check_placement(analyze_plan(PLANS["mlp-order"]), PLANS["mlp-order"].offsets)
    monkeypatch.setattr(run, "validate", analyze_plan)
    monkeypatch.setattr(run, "check_placement", lambda profile, offsets: arena)
    monkeypatch.setattr(run, "rehearse", lambda program, profile: (profile.live_bytes, 0))
    monkeypatch.setattr(simulate, "check_placement", lambda profile, offsets: arena)


def test_check_catches_a_plan_the_judges_were_told_to_ignore(judges_bypassed):
    """With the judges bypassed the run computes garbage, and the check must say so."""
    result = run_plan(_clobbered(PLANS["mlp-order"]), check=True)
    assert not result.check["passed"] and result.check["max_abs_diff"] > 0


# ---- the command line ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plans")
    return {name: write_plan(plan, directory / f"{name}.onnx") for name, plan in PLANS.items()}


def test_cli_run_json(cli, emitted):
    import json

    proc = cli("run", emitted["mlp-swap"], "--check", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plan = PLANS["mlp-swap"]
    profile = analyze_plan(plan)
    assert report["provider"] == "CPUExecutionProvider" and report["steps"] == 2
    assert report["measured"]["peak_bytes"] == report["predicted"]["peak_bytes"] == profile.peak_bytes
    assert report["measured"]["arena_bytes"] == report["predicted"]["arena_bytes"] == \
        check_placement(profile, plan.offsets)
    assert report["measured"]["step_time_s"] == report["step_times_s"][1]      # the first step faults pages in
    assert report["predicted"]["step_time_s"] > 0 and report["predicted"]["hardware"] == "cpu"
    assert report["check"]["max_abs_diff"] == 0.0 and report["check"]["passed"] is True
    assert report["swapped_bytes"] == {"dram": MLP.tensors["a"].nbytes, "nvdimm": MLP.tensors["W1"].nbytes}


def test_cli_run_predicts_with_the_profile_it_is_given(cli, emitted, tmp_path):
    """`run --hardware FILE`: the step time predicted with a profile calibrated here, not the bundled one."""
    import dataclasses
    import json

    from memsched import hardware
    from memsched.simulate import simulate

    bundled = hardware.load("cpu")
    mine = dataclasses.replace(bundled, name="this-machine",
                               op_class_overhead={cls: s + 1e-3 for cls, s in bundled.op_class_overhead.items()})
    (tmp_path / "mine.json").write_text(json.dumps(mine.to_dict()))
    proc = cli("run", emitted["mlp-order"], "--hardware", tmp_path / "mine.json", "--json")
    assert proc.returncode == 0, proc.stderr
    predicted = json.loads(proc.stdout)["predicted"]
    assert predicted["hardware"] == "this-machine"
    assert predicted["step_time_s"] == pytest.approx(simulate(PLANS["mlp-order"], mine).step_time, rel=1e-9)
    assert predicted["step_time_s"] > simulate(PLANS["mlp-order"], bundled).step_time + 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["recompute", "swap"])
def test_cli_run_checks_an_emitted_training_plan(cli, tmp_path, strategy):
    import json

    plan = strategy_plans(training_graph("bert-base"))[strategy]
    path = write_plan(plan, tmp_path / "scheduled.onnx")
    proc = cli("run", path, "--check", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["check"]["passed"] and report["check"]["max_abs_diff"] == 0.0
    for key in ("peak_bytes", "arena_bytes"):
        assert report["measured"][key] == report["predicted"][key]
    assert report["predicted"]["peak_bytes"] == analyze_plan(plan).peak_bytes


def test_cli_compile_then_run(cli, tmp_path):
    """The user's path: export a model, compile its training step to scheduled.onnx, run it."""
    import json

    model, scheduled = tmp_path / "mlp.onnx", tmp_path / "scheduled.onnx"
    assert cli("models", "export", "mlp", "-o", model, "--batch", "8").returncode == 0
    proc = cli("compile", model, "--train", "--hardware", "cpu", "--strategies", "order,reuse", "--time-limit", "1",
               "-o", scheduled, "--json")
    assert proc.returncode == 0, proc.stderr
    compiled = json.loads(proc.stdout)
    proc = cli("run", scheduled, "--check", "--steps", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["check"]["passed"] and report["check"]["max_abs_diff"] == 0.0
    # reuse fused the MLP's SGD updates into their weight-gradient Gemms: the run is also
    # checked against the model as given, which rounds those updates differently
    assert compiled["passes"]["reuse"]["fused_updates"] == 3
    given = report["check"]["given"]
    assert given["passed"] and given["steps"] == 2 and given["max_abs_diff"] <= 1e-6
    assert report["measured"]["peak_bytes"] == compiled["plan"]["peak_bytes"]
    assert report["measured"]["arena_bytes"] == compiled["plan"]["arena_bytes"]
    text = cli("run", scheduled, "--check")
    assert text.returncode == 0 and "check against the model as given" in text.stdout


@pytest.mark.slow     # a 3-D U-Net at 32^3: 17 s; tests/test_concat_split.py covers the split in the fast suite
def test_cli_compile_then_run_a_split_unet(cli, tmp_path):
    """The 3-D U-Net's decoder convolutions over Concat are split per part by reuse: the emitted
    step runs bit-identical to a plain run of itself and within rounding of the model as given."""
    import json

    model, scheduled = tmp_path / "unet3d.onnx", tmp_path / "scheduled.onnx"
    assert cli("models", "export", "unet3d", "-o", model, "--batch", "1", "--size", "32").returncode == 0
    proc = cli("compile", model, "--train", "--hardware", "cpu", "--strategies", "order,reuse", "--time-limit", "1",
               "-o", scheduled, "--json")
    assert proc.returncode == 0, proc.stderr
    compiled = json.loads(proc.stdout)
    assert compiled["passes"]["reuse"]["variant"] == "concat-split"
    assert compiled["graph"]["ops"] == 794          # the step as given: its Concats, one Conv each
    # one step: at 32^3 the split convolutions' rounding, carried through the first update, puts
    # the second step 1.9e-4 from the model as given (tolerance 1e-4)
    proc = cli("run", scheduled, "--check", "--steps", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["check"]["passed"] and report["check"]["max_abs_diff"] == 0.0
    given = report["check"]["given"]
    assert given["passed"] and 0 < given["max_abs_diff"] <= given["tolerance"]   # rounding only
    assert report["measured"]["peak_bytes"] == compiled["plan"]["peak_bytes"]
    text = cli("compile", model, "--train", "--hardware", "cpu", "--strategies", "order,reuse", "--time-limit", "1",
               "-o", tmp_path / "again.onnx")
    assert text.returncode == 0 and "reuse rewrote the step: convolutions over a Concat split per part" in text.stdout


def test_cli_run_text(cli, emitted):
    proc = cli("run", emitted["cnn-order"], "--check")
    assert proc.returncode == 0, proc.stderr
    assert "passed, bit-identical" in proc.stdout and "peak live bytes" in proc.stdout


def test_cli_run_rejects_a_hand_edited_plan_in_one_line(cli, tmp_path):
    path = write_plan(PLANS["mlp-order"], tmp_path / "scheduled.onnx")
    edit_plan_metadata(path, lambda doc: doc["schedule"].insert(
        [s[1] for s in doc["schedule"]].index("mm2") + 1, ["free", "r", None, "compute"]), reseal=True)
    proc = cli("run", path, "--check")
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("memsched: error: tensor 'r' is read by op 'rT'")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args, code, message", [
    (["missing.onnx"], 1, "no such file"),
    (["PLAIN", "--check"], 1, "holds no memsched plan"),
    (["UNPLACED"], 1, "no arena offsets"),
    (["PLAN", "--steps", "0"], 1, "--steps must be at least 1"),
    (["PLAN", "--device", "tpu"], 1, "invalid choice"),
])
def test_cli_run_bad_input(cli, tmp_path, emitted, args, code, message):
    plain = tmp_path / "plain.onnx"
    plain.write_bytes(MLP.to_onnx().SerializeToString())
    unplaced = write_plan(dataclasses.replace(PLANS["mlp-order"], offsets=None), tmp_path / "unplaced.onnx")
    names = {"PLAIN": plain, "UNPLACED": unplaced, "PLAN": emitted["mlp-order"],
             "missing.onnx": tmp_path / "missing.onnx"}
    proc = cli("run", *[names.get(a, a) for a in args])
    assert proc.returncode == code and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_failed_check_exits_1_with_one_line(judges_bypassed, tmp_path, capsys):
    """A run whose outputs differ (the judges bypassed, as above) fails the command."""
    from memsched import cli

    path = write_plan(_clobbered(PLANS["mlp-order"]), tmp_path / "clobbered.onnx")
    assert cli.main(["run", str(path), "--check", "--json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memsched: error: check failed: output '") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["cnn", pytest.param("bert-base", marks=pytest.mark.slow)])
def test_float16_training_steps_run_and_follow_the_float32_step(name):
    """The loss's, MaxPool's and the embedding's gradients scatter-add; a float16 model adds in
    float32 (ONNX Runtime's CPU provider has no float16 add), so its backward runs, checks
    bit-identical, and its gradients follow the float32 model's: to 1% of each gradient's norm,
    plus 1e-4 of the largest element (gradients that are zero in exact arithmetic, as attention's
    key bias, or near float16's smallest normal, as its key weights, are float16 noise)."""
    from memsched.passes.training import build_training_step

    grads = {}
    for dtype in (np.float32, np.float16):
        model = cnn_graph(dtype=dtype) if name == "cnn" else small_model(name, dtype=np.dtype(dtype).name)
        graph = build_training_step(model, loss="cross_entropy")
        result = run_plan(order_plan(graph), check=True)
        assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
        grads[dtype] = {out: result.outputs[out].astype(np.float64) for out in graph.outputs if out.endswith(".grad")}
    assert grads[np.float32].keys() == grads[np.float16].keys() and grads[np.float32]
    largest = max(np.abs(g).max() for g in grads[np.float32].values())
    for param, exact in grads[np.float32].items():
        error = np.linalg.norm(grads[np.float16][param] - exact)
        assert error <= 0.01 * np.linalg.norm(exact) + 1e-4 * largest, param


# ---- segments and the process's real memory ---------------------------------------------------
def test_a_training_step_runs_in_few_sessions_and_reports_real_memory():
    """order,reuse on a network's training step: one session covers many op runs, Constant
    ops are written by the executor, and the run reports the process's memory beside the arena."""
    plan = strategy_plans(training_graph("bert-base"))["reuse"]
    result = run_plan(plan, check=True, steps=2, threads=1)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    _assert_measured_equals_planned(result, plan)
    assert result.sessions * 20 < result.ops
    process = result.process
    assert process["arena_bytes"] == process["host_arena_bytes"] == result.arena_bytes
    assert process["store_bytes"] == 0 and process["includes_check"] is True
    if process["rss_source"] != "unavailable":     # in a long-lived process freed pages may be reused: >= 0
        assert process["rss_growth_bytes"] >= 0 and process["setup_growth_bytes"] >= 0
        assert process["overhead_bytes"] == process["rss_growth_bytes"] - process["arena_bytes"]
        assert process["file_growth_bytes"] is None or isinstance(process["file_growth_bytes"], int)


def test_outputs_of_the_last_step_are_read_only_views_of_the_arena():
    result = run_plan(PLANS["mlp-reuse"], steps=2)
    loss = result.outputs["loss"]
    assert not loss.flags.writeable and not loss.flags.owndata


def test_the_order_guard_cuts_where_onnx_runtime_could_reorder():
    """A Shape run that writes where a run it does not depend on read must not share its
    session: ONNX Runtime's priority order takes Shape nodes as soon as they are ready."""
    read = program.Run(dataclasses.replace(MLP.ops[0], op_type="Relu"), [("a", 0, 64)], [(("b", 0), 64, 128, None)])
    shape = program.Run(dataclasses.replace(MLP.ops[0], op_type="Shape"), [("c", 256, 320)],
                        [(("s", 0), 0, 16, None)])
    plain = program.Run(dataclasses.replace(MLP.ops[0], op_type="Relu"), [("c", 256, 320)], [(("d", 0), 0, 64, None)])
    for order, candidate, admitted in ((program._OrderGuard.ORDERED, shape, False),
                                       (program._OrderGuard.ORDERED, plain, True),
                                       (program._OrderGuard.ANY, plain, False)):
        guard = program._OrderGuard(order)
        assert guard.admit(read)
        assert guard.admit(candidate) is admitted, (order, candidate.op.op_type)
    # a run that depends on the reader (through its output) may write there in any order
    after = program.Run(dataclasses.replace(MLP.ops[0], op_type="Shape"), [("b", 64, 128)], [(("s", 0), 0, 16, None)])
    guard = program._OrderGuard(program._OrderGuard.ANY)
    assert guard.admit(read) and guard.admit(after)


def test_cli_run_json_reports_process_memory(cli, emitted):
    import json

    proc = cli("run", emitted["mlp-reuse"], "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["threads"] == 0
    process = report["process"]
    assert process["arena_bytes"] == report["measured"]["arena_bytes"]
    if process["rss_source"] != "unavailable":
        assert process["rss_growth_bytes"] > 0 and process["setup_growth_bytes"] >= 0
    text = cli("run", emitted["mlp-reuse"], "--threads", "1")
    assert text.returncode == 0 and "process memory growth (RSS)" in text.stdout


def test_swap_copies_run_inside_the_session_around_them_on_the_cpu():
    """On the CPU a swap copy is an Identity node of the session that runs the ops around it,
    so a plan that swaps runs in as few sessions as one that does not; the arena bytes a
    swapped-out tensor leaves are written by another tensor before it comes back, so a copy
    that ran out of place would fail the bit-identical check."""
    from memsched.memory import analyze_plan, buffer_roots

    plan = with_swaps(PLANS["mlp-reuse"], every=1)
    profile = analyze_plan(plan)
    roots = buffer_roots(profile)
    schedule = plan.schedule
    overwritten = []
    for i, step in enumerate(schedule):
        if step.kind != "swap_out":
            continue
        back = next(j for j in range(i + 1, len(schedule)) if schedule[j].kind == "swap_in"
                    and schedule[j].target == step.target)
        out = next(r for r in profile.residencies if r.tensor == step.target and r.start <= i <= r.end)
        lo = plan.offsets[roots[out.key]]
        overwritten += [r.tensor for r in profile.residencies if i < r.start < back and r.nbytes
                        and plan.offsets[roots[r.key]] < lo + out.nbytes and lo < plan.offsets[roots[r.key]] + r.nbytes]
    assert overwritten, "no swapped-out tensor's bytes are reused before it comes back"
    result = run_plan(plan, check=True, steps=2, threads=1)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    assert result.sessions == run_plan(PLANS["mlp-reuse"], threads=1).sessions == 1


def _flattened_batch(relu: bool):
    """x (4, 2, 3) -> Flatten f (a view of x) [-> Relu r, in place over f] -> Gemm y: a plan whose
    view of the batch shares its storage, and (with `relu`) an op that writes over that storage."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TP.FLOAT, [5, 6], rng.standard_normal(30).astype(np.float32).tolist())
    nodes = [helper.make_node("Flatten", ["x"], ["f"], name="flatten")]
    if relu:
        nodes.append(helper.make_node("Relu", ["f"], ["r"], name="relu"))
    nodes.append(helper.make_node("Gemm", ["r" if relu else "f", "w"], ["y"], name="fc", transB=1))
    graph = lower_graph(nodes, [helper.make_tensor_value_info("x", TP.FLOAT, [4, 2, 3])],
                        [helper.make_tensor_value_info("y", TP.FLOAT, [4, 5])], [w], "flattened")
    aliases = {"f": "x", **({"r": "f"} if relu else {})}
    return place(Plan(graph, default_schedule(graph), aliases=aliases)), \
        {"x": rng.standard_normal((4, 2, 3)).astype(np.float32)}


def _arena_writes(monkeypatch) -> list[int]:
    """The arena offsets `_Runtime.write` is called for (the inputs and statics a step loads)."""
    offsets, write = [], device.Runtime.write
    monkeypatch.setattr(device.Runtime, "write", lambda rt, lo, value: (offsets.append(lo), write(rt, lo, value)))
    return offsets


def test_the_batch_and_its_views_are_read_in_place_on_the_cpu(monkeypatch):
    plan, feeds = _flattened_batch(relu=False)
    read = program.host_inputs(plan, feeds)
    assert set(read) == {"x", "f"} and read["f"].ctypes.data == feeds["x"].ctypes.data
    assert program.host_inputs(plan, feeds, device="cuda") == {}
    writes = _arena_writes(monkeypatch)
    result = run_plan(plan, check=True, steps=2, inputs=feeds)     # the arena is NaN but what a step writes
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    assert plan.offsets[("x", 0)] not in writes


def test_a_batch_an_op_writes_over_is_copied_into_the_arena(monkeypatch):
    plan, feeds = _flattened_batch(relu=True)
    assert program.host_inputs(plan, feeds) == {}
    writes = _arena_writes(monkeypatch)
    result = run_plan(plan, check=True, steps=2, inputs=feeds)
    assert result.check["passed"] and result.check["max_abs_diff"] == 0.0
    assert plan.offsets[("x", 0)] in writes
    assert feeds["x"].min() < 0       # the caller's batch kept its negative values: Relu ran on the copy


def test_a_plan_larger_than_the_host_is_one_line_before_any_allocation(monkeypatch, no_sessions):
    """The arena (and the made-up inputs) are checked against the host's memory first: a plan
    too large for the host is one line naming both sizes, not a MemoryError. (The host's size
    is patched down, as a plan of a TiB would need it to be.)"""
    from memsched import measure

    plan = PLANS["mlp-order"]
    arena = max(offset + plan.graph.tensors[t].nbytes for (t, _), offset in plan.offsets.items())
    monkeypatch.setattr(measure, "host_memory_bytes", lambda: arena - 1)
    with pytest.raises(UserError, match=r"the plan's arena needs .* B\); this host has"):
        run_plan(plan)
    monkeypatch.setattr(measure, "host_memory_bytes", lambda: 1)
    with pytest.raises(UserError, match=r"the step's input data needs .*; this host has 1 B"):
        run_plan(plan)
