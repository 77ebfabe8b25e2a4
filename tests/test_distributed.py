"""Data-parallel runs on torch.distributed (gloo, loopback): 2 ranks on B match 1 rank on 2B.

Each run starts 2 processes with a timeout, so a hung rank fails the test instead of the suite."""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest

from memsched.emit import read_plan, write_plan
from memsched.errors import UserError
from memsched.step_info import step_info
from memsched import views
from memsched.runtime import run_plan
from memsched.memory import validate
from memsched.models.cnn import plain_cnn, small_resnet
from memsched.passes.pipeline import compile as compile_plan

torch = pytest.importorskip("torch")
from memsched.runtime.distributed import global_inputs, import_torch, launch, shard  # noqa: E402

WORKERS, BATCH, STEPS = 2, 4, 2      # the whole batch is WORKERS * BATCH
TIMEOUT_S = 120


def mlp(batch: int) -> onnx.ModelProto:
    from memsched import models

    return models.build("mlp", batch=batch, size=8, hidden=[16])


def small_cnn(batch: int) -> onnx.ModelProto:
    return plain_cnn(batch=batch, size=8, widths=(8, 8))


def compiled(model: onnx.ModelProto, tmp_path, workers: int | None, bucket_bytes: int = 512):
    path = tmp_path / f"model{workers}.onnx"
    onnx.save(model, str(path))
    return compile_plan(path, train=True, data_parallel=workers, bucket_bytes=bucket_bytes, time_limit=1,
                        hardware="cpu", strategies="order,reuse").plan


def _two_ranks_against_one(model: onnx.ModelProto, tmp_path, sync_batchnorm: bool = False):
    """(the 2-worker plan's path, the run's summary, {updated weight: the worse rank's largest
    difference from one rank's run on the whole batch, relative to the weight's largest value}),
    after STEPS steps; both ranks must hold the same weights."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    plan = compiled(model, tmp_path, WORKERS)
    one = compiled(model, tmp_path, None)
    path = write_plan(plan, tmp_path / "plan.onnx")
    inputs = global_inputs(plan, WORKERS)
    inputs["labels"] = np.random.default_rng(1).integers(0, 10, WORKERS * BATCH)
    np.savez(tmp_path / "inputs.npz", **inputs)
    summary = launch(str(path), WORKERS, steps=STEPS, inputs=str(tmp_path / "inputs.npz"), outputs=str(tmp_path),
                     timeout=TIMEOUT_S, sync_batchnorm=sync_batchnorm)
    expected = run_plan(one, steps=STEPS, inputs=inputs, threads=1).outputs
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in range(WORKERS)]
    errors = {}
    # the updated weights and optimizer states; not BatchNorm's running statistics, which each rank
    # keeps from its own batches (docs/training.md)
    buffers = {f"{b}.updated" for b in step_info(plan.graph).buffers}
    for name in (n for n in expected if n.endswith(".updated") and n not in buffers):
        want = expected[name].astype(np.float64)
        errors[name] = max(float(np.abs(rank[name] - want).max() / np.abs(want).max()) for rank in ranks)
        assert ranks[0][name].tobytes() == ranks[1][name].tobytes()
    return path, summary, errors


@pytest.mark.parametrize("build", [mlp, pytest.param(small_cnn, marks=pytest.mark.slow)])   # the MLP in the fast suite
def test_two_ranks_on_b_update_as_one_rank_on_2b(build, tmp_path, capsys):
    """The averaged gradients of 2 ranks on B rows each are the gradient of 2B rows (mean losses):
    after STEPS steps every updated weight matches one rank's run on the whole batch within 1e-5
    relative, and both ranks hold the same weights. Each rank's measured peak (the executor's
    arena accounting) is the plan's per-worker peak, and the run's table (`run --workers`
    without --json) prints it next to the predicted one."""
    path, summary, errors = _two_ranks_against_one(build(WORKERS * BATCH), tmp_path)
    assert len(errors) >= 4 and max(errors.values()) <= 1e-5, errors
    peak = validate(read_plan(path)).peak_bytes
    assert summary["measured"]["per_worker_peak_bytes"] == [peak] * WORKERS == [summary["predicted"]["peak_bytes"]] * 2
    assert len(summary["buckets"]) >= 2 and summary["workers"] == WORKERS
    assert all(len(r["step_times_s"]) == STEPS and len(r["allreduce_wait_s"]) == STEPS for r in summary["ranks"])
    assert 0.0 <= summary["measured"]["overlap_fraction"] <= 1.0
    assert summary["predicted"]["step_overlap_s"] < summary["predicted"]["step_no_overlap_s"]
    views.print_data_parallel_run(summary, sync_batchnorm=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"ran {STEPS} step(s) of {path} on {WORKERS} workers")
    assert lines[2].split()[-2:] == [f"{peak:,}", f"{peak:,}"] and lines[2].startswith("peak bytes per worker")


@pytest.mark.slow
def test_synchronised_batchnorm_makes_two_ranks_one_batch(tmp_path):
    """A small ResNet: with synchronised BatchNorm, 2 ranks on B rows each update every weight
    as 1 rank on the 2B rows does, within 1e-5; with each rank's own batch statistics (the
    default, as DDP) they do not."""
    model = small_resnet(batch=WORKERS * BATCH)
    _, summary, synced = _two_ranks_against_one(model, tmp_path / "sync", sync_batchnorm=True)
    # 6 BatchNorms, each with its mean and variance forward and two sums backward
    assert summary["synchronised_batch_statistics"] == 6 * 4
    assert max(synced.values()) <= 1e-5, synced
    _, _, own = _two_ranks_against_one(model, tmp_path / "own")
    assert max(own.values()) > 1e-3, own


def test_bad_plans_and_batches_are_one_line_errors(tmp_path, cli):
    model = mlp(WORKERS * BATCH)
    plan = compiled(model, tmp_path, WORKERS)
    path = write_plan(plan, tmp_path / "plan.onnx")
    with pytest.raises(UserError, match="compiled for 2 workers .* not 3"):
        launch(str(path), 3)
    done = cli("run", path, "--workers", "3")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "memsched: error: the plan was compiled for 2 workers (--data-parallel), not 3\n"
    single = write_plan(compiled(model, tmp_path, None), tmp_path / "single.onnx")
    with pytest.raises(UserError, match="compiled for one worker"):
        launch(str(single), 2)
    inputs = global_inputs(plan, WORKERS)
    assert inputs["input"].shape[0] == WORKERS * BATCH
    mine = shard(plan, inputs, 1, WORKERS)
    assert np.array_equal(mine["input"], inputs["input"][BATCH:]) and mine["labels"].shape == (BATCH,)
    with pytest.raises(UserError, match="does not divide among 2 workers"):
        shard(plan, {**inputs, "input": inputs["input"][:-1]}, 0, WORKERS)
    with pytest.raises(UserError, match="takes 4 rows per worker, 8 in all"):
        shard(plan, {**inputs, "input": inputs["input"][:6]}, 0, WORKERS)


def test_missing_torch_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(UserError, match=r"install 'memsched\[distributed\]'"):
        import_torch()


# ---- processes: ranks that cannot meet, launchers that die ---------------------------------
def _rank(path, rank: int, port, timeout: float = 2.0):
    import os
    import subprocess

    env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.run([sys.executable, "-m", "memsched.runtime.distributed", str(path), "--timeout", str(timeout),
                           "--summary", str(path) + ".json"], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_rank_that_cannot_meet_its_group_is_one_line(tmp_path):
    import socket

    from memsched.runtime.distributed import free_port

    path = write_plan(compiled(mlp(WORKERS * BATCH), tmp_path, WORKERS), tmp_path / "plan.onnx")
    lonely = _rank(path, 1, free_port())                          # nobody listens there
    assert lonely.returncode == 1 and lonely.stderr.count("\n") == 1
    assert "rank 1 cannot reach rank 0's store at 127.0.0.1:" in lonely.stderr and "within 2 s" in lonely.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:         # another program has the port
        busy = _rank(path, 0, taken.getsockname()[1])
    assert busy.returncode == 1 and busy.stderr.count("\n") == 1
    assert "rank 0 cannot listen on 127.0.0.1:" in busy.stderr and "choose a free MASTER_PORT" in busy.stderr


@pytest.mark.parametrize("port", ["abc", "0", "70000", "", "８０"])
def test_a_master_port_is_a_tcp_port(monkeypatch, port):
    from memsched.runtime.distributed import _store_address

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", port)
    with pytest.raises(UserError, match=f"MASTER_PORT={port!r}"):
        _store_address()
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert _store_address() == ("127.0.0.1", 29500)


def _children(pid: int) -> set[int]:
    from pathlib import Path

    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pids) -> set[int]:
    """Those of `pids` still running (a zombie is not)."""
    alive = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        except OSError:
            pass
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signal_name, exit_code", [("SIGTERM", 143), ("SIGINT", 130), ("SIGKILL", -9)])
def test_no_rank_outlives_its_launcher(tmp_path, signal_name, exit_code):
    """SIGTERM or Ctrl-C to `run --workers 2` stops its ranks on the way out (exit 143, 130);
    SIGKILL (no way out) stops them too, through the kernel (PR_SET_PDEATHSIG). Waits are
    bounded polls, not timings."""
    import os
    import signal
    import subprocess
    import time

    path = write_plan(compiled(mlp(WORKERS * BATCH), tmp_path, WORKERS), tmp_path / "plan.onnx")
    launcher = subprocess.Popen([sys.executable, "-m", "memsched", "run", str(path), "--workers", "2",
                                 "--steps", "100000"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):                           # the ranks start (up to 60 s on a loaded machine)
            ranks = _children(launcher.pid)
            if len(ranks) == 2:
                break
            time.sleep(0.1)
        assert len(ranks) == 2, launcher.stderr.read() if launcher.poll() is not None else "no ranks started"
        launcher.send_signal(getattr(signal, signal_name))
        assert launcher.wait(timeout=60) == exit_code, launcher.stderr.read()
        for _ in range(300):
            if not _alive(ranks):
                break
            time.sleep(0.1)
        assert not _alive(ranks), f"ranks {sorted(_alive(ranks))} outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in _alive(_children(launcher.pid)):
            os.kill(pid, signal.SIGKILL)


def test_a_record_that_leaves_a_per_sample_input_out_is_refused(tmp_path):
    """A data-parallel record (resealed by hand) listing only the labels as per-sample would
    run every rank on the same rows of the data: refused before any rank starts."""
    import json

    from memsched.data_parallel import PLAN_KEY
    from memsched.runtime.distributed import check_plan

    plan = compiled(mlp(WORKERS * BATCH), tmp_path, WORKERS)
    check_plan(plan, WORKERS)
    record = json.loads(plan.graph.metadata[PLAN_KEY])
    plan.graph.metadata[PLAN_KEY] = json.dumps({**record, "batch_inputs": ["labels"]})
    with pytest.raises(UserError, match="does not match its inputs at 'input'"):
        check_plan(plan, WORKERS)
