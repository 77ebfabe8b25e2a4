"""bench/gpu_cap.py on the CPU: the batch search with a fake predicate, the loss comparison,
PyTorch's step and its out-of-memory verdict, and the dry run end to end."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_cap  # noqa: E402


def search(threshold: int, start: int = 1, limit: int = 1024):
    """largest_batch with a predicate true up to `threshold`, and every batch it asked about."""
    asked = []

    def fits(batch: int) -> bool:
        asked.append(batch)
        return batch <= threshold

    batch, trials = gpu_cap.largest_batch(fits, start, limit)
    assert [b for b, _ in trials] == asked and [ok for _, ok in trials] == [b <= threshold for b in asked]
    return batch, asked


def test_the_search_doubles_then_bisects():
    batch, asked = search(6)
    assert batch == 6 and asked == [1, 2, 4, 8, 6, 7]
    batch, asked = search(100, start=3)
    assert batch == 100 and asked[:6] == [3, 6, 12, 24, 48, 96] and asked[6] == 192


@pytest.mark.parametrize("start,limit", [(1, 1), (1, 64), (1, 1000), (3, 20), (5, 5), (7, 300)])
def test_the_search_finds_the_largest_batch_within_its_bounds(start, limit):
    for threshold in range(0, limit + 40):
        batch, asked = search(threshold, start, limit)
        assert batch == (min(threshold, limit) if threshold >= start else 0)
        assert all(start <= b <= limit for b in asked) and len(set(asked)) == len(asked)
        assert len(asked) <= 2 * math.ceil(math.log2(limit / start + 1)) + 2


def test_the_search_stops_at_its_limit_and_at_a_first_batch_that_does_not_fit():
    assert search(10 ** 6, limit=20) == (20, [1, 2, 4, 8, 16, 20])
    assert search(0) == (0, [1])
    assert search(4, start=5) == (0, [5])
    for start, limit in [(0, 8), (9, 8), (-1, -1)]:
        with pytest.raises(ValueError, match="batch range"):
            gpu_cap.largest_batch(lambda batch: True, start, limit)


def test_losses_agree_within_the_tolerance_scaled_by_the_loss():
    assert gpu_cap.compare_losses([6.9, 6.8], [6.9, 6.8])["match"]
    near = gpu_cap.compare_losses([6.9 + 5e-4, 0.5 + 5e-5], [6.9, 0.5])
    assert near["match"] and near["max_scaled_diff"] == pytest.approx(5e-4 / 6.9)
    far = gpu_cap.compare_losses([0.5 + 2e-4], [0.5])
    assert not far["match"] and far["max_scaled_diff"] == pytest.approx(2e-4)
    assert not gpu_cap.compare_losses([0.5, math.nan], [0.5, 0.4])["match"]
    assert not gpu_cap.compare_losses([0.5], [0.5, 0.4])["match"]
    assert not gpu_cap.compare_losses([], [])["match"]


def test_pytorch_steps_on_the_cpu_and_an_out_of_memory_error_is_no_fit(monkeypatch):
    torch = pytest.importorskip("torch")
    row = gpu_cap.torch_steps("bert-tiny", 2, 1, "cpu", None)
    assert row["fits"] and row["batch"] == 2 and row["step_time_s"] > 0

    class Full(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(gpu_cap, "torch_module", lambda label: (Full(), "a full device"))
    row = gpu_cap.torch_steps("bert-tiny", 2, 1, "cpu", None)
    assert row["fits"] is False and "out of memory" in row["error"]


def test_pytorchs_peak_on_the_meta_device_grows_with_the_batch():
    pytest.importorskip("torch")
    peaks = [gpu_cap.meta_peak("bert-tiny", batch) for batch in (1, 4, 16)]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]




def dry_run(tmp_path, *models: str) -> dict:
    out = tmp_path / "gpu_cap.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_cap.py"), "--dry-run", "--models",
                           ",".join(models), "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    return report


def check_row(row: dict) -> None:
    """A dry run's row: the cap is PyTorch's peak at DRY_BATCH, so that is its largest batch;
    memsched trains twice that within the same bytes, with the CPU reference's losses."""
    torch_side, memsched = row["torch"], row["memsched"]
    assert torch_side["largest_batch"] == gpu_cap.DRY_BATCH
    assert [b for b, ok in torch_side["trials"] if ok][-1] == gpu_cap.DRY_BATCH
    assert torch_side["time_per_sample_s"] > 0
    assert memsched["batch"] == row["memsched"]["run"]["batch"] == 2 * gpu_cap.DRY_BATCH
    assert row["batch_over_torch"] == 2
    assert memsched["planned_peak_bytes"] <= memsched["budget_bytes"] == row["cap_bytes"]
    assert len(memsched["run"]["losses"]) == 2 and memsched["losses"]["match"]
    assert all(math.isfinite(loss) for loss in memsched["run"]["losses"])
    assert row["time_per_sample_vs_torch"] > 0


def test_the_dry_run_on_one_model(tmp_path):
    pytest.importorskip("torch")
    report = dry_run(tmp_path, "resnet18-64")
    assert report["dry_run"] is True and report["device"] == "cpu (dry run)"
    check_row(report["models"][0])
    assert report["summary"] == {"models": 1, "trained": 1, "batch_at_least_2x": True, "losses_match": True,
                                 "within_cap": None}


@pytest.mark.slow
def test_the_dry_run_on_its_default_models(tmp_path):
    pytest.importorskip("torch")
    report = dry_run(tmp_path, *gpu_cap.DRY_MODELS)
    assert [row["model"] for row in report["models"]] == list(gpu_cap.DRY_MODELS)
    for row in report["models"]:
        check_row(row)


def test_a_plan_compiled_beforehand_is_used_only_where_it_is_large_and_small_enough(monkeypatch, tmp_path):
    """--plans: the manifest's plan where its batch is at least the one asked for and its budget
    within this run's (cap less the measured overhead and the workspace); else one compiled here."""
    compiled = []
    monkeypatch.setattr(gpu_cap, "compile_case", lambda label, batch, budget, *rest: compiled.append(batch) or {
        "model": label, "batch": batch, "budget_bytes": budget, "plan_file": "here.onnx", "weights": {}})
    monkeypatch.setattr(gpu_cap, "refill_weights", lambda path, stats, folder: path)
    setting = gpu_cap.Setting(cap=1000, overhead=100, workspace=50, hardware="h200", steps=2, time_limit=1.0,
                              max_batch=64, scratch=tmp_path, dry_run=False, plans=tmp_path / "plans",
                              manifest={"bert-base": {"model": "bert-base", "batch": 40, "budget_bytes": 800,
                                                      "plan_file": "ahead.onnx", "weights": {}}})
    entry, path = gpu_cap.plan_for("bert-base", 36, setting)
    assert entry["compiled"] == "beforehand (--plans)" and path == tmp_path / "plans" / "ahead.onnx"
    assert not compiled
    entry, path = gpu_cap.plan_for("bert-base", 42, setting)               # PyTorch reached more
    assert entry["compiled"] == "here" and compiled == [42] and entry["budget_bytes"] == 850
    setting.overhead = 200                                                  # the overhead measured is larger
    assert gpu_cap.plan_for("bert-base", 36, setting)[0]["compiled"] == "here" and compiled == [42, 36]
    monkeypatch.setattr(gpu_cap, "compile_case", lambda label, batch, budget, *rest: {
        "model": label, "batch": batch, "error": "the budget cannot be met"})
    assert gpu_cap.plan_for("resnet50", 8, setting) == ({"model": "resnet50", "batch": 8, "compiled": "here",
                                                         "error": "the budget cannot be met"}, None)


@pytest.mark.slow
def test_plans_compiled_ahead_are_trained_by_a_later_run(tmp_path):
    """--compile-to here, then a run with --plans (a dry run stands in for the GPU's)."""
    pytest.importorskip("torch")
    plans = tmp_path / "plans"
    bench = [sys.executable, str(ROOT / "bench" / "gpu_cap.py"), "--models", "resnet18-64", "--cap", "100MiB"]
    proc = subprocess.run([*bench, "--compile-to", str(plans), "--overhead", "1MiB", "--workspace", "1MiB"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ahead = json.loads((plans / "manifest.json").read_text())["compiled"][0]
    assert ahead["batch"] == 2 * ahead["meta_largest_batch"] and (plans / ahead["plan_file"]).exists()
    proc = subprocess.run([*bench, "--dry-run", "--plans", str(plans)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout)["models"][0]
    assert row["torch"]["largest_batch"] == ahead["meta_largest_batch"]
    assert row["memsched"]["compiled"] == "beforehand (--plans)" and row["memsched"]["batch"] == ahead["batch"]
    assert row["memsched"]["losses"]["match"] and row["batch_over_torch"] >= 2
