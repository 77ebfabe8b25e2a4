"""memsched doctor, the CUDA library finder and bench/gpu_check.py, on a machine without a GPU."""
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from memsched import cli
from memsched import cuda, doctor

ROOT = Path(__file__).resolve().parent.parent
no_gpu = pytest.mark.skipif(bool(cuda.gpus()), reason="a GPU is present: these tests check the CPU-only answers")


@no_gpu
def test_doctor_says_why_cuda_is_off(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cuda_usable"] is False
    assert report["reason"] and report["fix"]
    assert "CUDAExecutionProvider" in report["onnxruntime"]["providers"] or "no CUDA" in report["reason"]
    assert cli.main(["doctor"]) == 0
    assert "CUDA is not usable" in capsys.readouterr().out


def test_doctor_reasons_come_in_the_order_a_session_needs_them(monkeypatch):
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert doctor.diagnose()["fix"] == doctor.FIX_BUILD
    monkeypatch.setattr(onnxruntime, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(cuda, "loadable", lambda name: False)
    assert doctor.diagnose()["fix"] == doctor.FIX_DRIVER
    monkeypatch.setattr(cuda, "loadable", lambda name: True)
    monkeypatch.setattr(cuda, "required_libraries", lambda: [cuda.DRIVER, "libcublas.so.13", cuda.CUDNN])
    monkeypatch.setattr(cuda, "locate", lambda names: {name: None for name in names})
    report = doctor.diagnose()
    assert report["fix"] == doctor.FIX_LIBRARIES
    assert report["reason"] == "CUDA libraries not found: libcublas.so.13, libcudnn.so.9"


def test_the_provider_needs_are_read_from_the_installed_library():
    library = cuda.provider_library()
    if library is None:
        pytest.skip("this ONNX Runtime has no CUDA provider")
    needed = cuda.elf_needed(library)
    assert any(name.startswith("libcudart.so.") for name in needed)
    required = cuda.required_libraries()
    assert required[0] == cuda.DRIVER and required[-1] == cuda.CUDNN
    assert not any(name.startswith(("libc.so", "libstdc++")) for name in required)


def test_elf_needed_refuses_what_is_not_elf(tmp_path):
    path = tmp_path / "libnot.so"
    path.write_bytes(b"not an elf file at all")
    with pytest.raises(ValueError, match="not a 64-bit"):
        cuda.elf_needed(path)


def test_locate_finds_a_library_in_a_wheel_folder(tmp_path, monkeypatch):
    folder = tmp_path / "nvidia" / "cu13" / "lib"
    folder.mkdir(parents=True)
    (folder / "libmemschedtest.so.1").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + sys.path)
    assert cuda.locate(["libmemschedtest.so.1", "libabsent.so.7"]) == {
        "libmemschedtest.so.1": str(folder / "libmemschedtest.so.1"), "libabsent.so.7": None}


def test_the_cuda_extra_ships_every_library_the_provider_links():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cuda"]
    packages = {requirement.split(">")[0].split("=")[0].split("<")[0].strip() for requirement in extra}
    required = cuda.required_libraries() or ["libcudart.so.13", "libcublas.so.13", "libcurand.so.10", cuda.CUDNN]
    for name in required:
        if name == cuda.DRIVER:
            continue
        assert cuda.WHEELS[name.split(".so")[0]] in packages, name


@no_gpu
@pytest.mark.parametrize("script, says", [("gpu_check.py", ["CUDA is not usable here"]),
                                          ("gpu_cap.py", ["CUDA is not usable here", "--dry-run"])])
def test_a_gpu_bench_without_a_gpu_says_so_in_one_line(script, says):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and all(words in lines[0] for words in says)


@pytest.mark.slow
def test_the_cuda_extra_resolves(tmp_path):
    """pip resolves the extra's wheels for this Python (from the package index; nothing installed)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(tmp_path / "report.json"), f"{ROOT}[cuda]"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = {item["metadata"]["name"] for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert set(cuda.WHEELS.values()) <= names


def test_cuda_sessions_bound_the_providers_own_memory():
    from memsched.ort import providers_for

    (name, options), fallback = providers_for("cuda")
    assert name == "CUDAExecutionProvider" and fallback == "CPUExecutionProvider"
    assert options["arena_extend_strategy"] == "kSameAsRequested"
    assert options["cudnn_conv_use_max_workspace"] == "0"
    assert providers_for("cpu") == ["CPUExecutionProvider"]


def test_cuda_sessions_take_a_small_cublas_workspace_unless_the_user_set_one(monkeypatch):
    """Each CUDA session keeps cuBLAS handles of its own: their workspace is made small before
    the first session (153 MB -> 19 MB a session on an H200), and a user's setting wins."""
    from memsched.ort import providers_for

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    providers_for("cuda")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == cuda.CUBLAS_WORKSPACE == ":16:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    providers_for("cuda")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    providers_for("cpu")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_checked_cuda_runs_keep_float32_kernels_off_tf32():
    """A checked run compares the plan, not two TF32 algorithms: its sessions and the
    reference's are made with use_tf32 off; an unchecked run keeps ONNX Runtime's default."""
    from memsched.ort import providers_for

    (_, checked), _ = providers_for("cuda", tf32=False)
    (_, plain), _ = providers_for("cuda")
    assert checked["use_tf32"] == "0" and "use_tf32" not in plain


# ---- the fixed per-process device overhead and the run's device accounting ------------------
@no_gpu
def test_doctor_says_the_fixed_overhead_cannot_be_measured_without_cuda(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    overhead = json.loads(capsys.readouterr().out)["fixed_overhead"]
    assert overhead["bytes"] is None and "cannot be measured on this machine" in overhead["reason"]
    assert cli.main(["doctor"]) == 0
    assert "fixed device memory per process: not measured; cannot be measured" in capsys.readouterr().out
    assert cuda.fixed_overhead() == {"bytes": None, "source": None, "reason": cuda.NO_CUDA}


def test_the_fixed_overhead_is_measured_once_per_configuration(monkeypatch, tmp_path):
    """One probe per GPU, driver, ONNX Runtime and cuBLAS setting: kept in the process and in a
    file the next process reads; `refresh` (doctor) measures again."""
    from memsched import ort

    probes = []
    monkeypatch.setattr(cuda, "_overhead", None)
    monkeypatch.setattr(cuda, "_overhead_key", lambda: "k1")
    monkeypatch.setattr(ort, "resolve_device", lambda device: ("cuda", None))
    monkeypatch.setattr(cuda.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(cuda, "_run_probe", lambda timeout: probes.append(1) or {
        "bytes": 600 << 20, "source": "NVML", "reason": None})
    first = cuda.fixed_overhead()
    assert first["bytes"] == 600 << 20 and first["cached"] is None and len(probes) == 1
    assert cuda.fixed_overhead() is first and len(probes) == 1
    monkeypatch.setattr(cuda, "_overhead", None)          # a new process: the file
    again = cuda.fixed_overhead()
    assert again["bytes"] == 600 << 20 and again["cached"].endswith("memsched-fixed-overhead-k1.json")
    assert len(probes) == 1
    assert cuda.fixed_overhead(refresh=True)["cached"] is None and len(probes) == 2
    monkeypatch.setattr(cuda, "_overhead_key", lambda: "k2")      # another driver, say
    cuda.fixed_overhead()
    assert len(probes) == 3


def test_a_failed_probe_says_why(monkeypatch):
    monkeypatch.setattr(cuda, "_PROBE", "import sys; sys.exit('no device here')")
    result = cuda._run_probe(60)
    assert result["bytes"] is None and result["reason"] == "the probe failed: no device here"


@no_gpu
def test_nvml_without_a_driver_is_a_user_error():
    from memsched.errors import UserError

    with pytest.raises(UserError, match="no NVIDIA driver"):
        cuda.Nvml()


class _FakeNvml:
    """The NVML calls `cuda.gpus` makes, for three GPUs of which the second has no handle."""

    def __init__(self):
        self.shutdowns = 0

    def nvmlInit_v2(self):
        return 0

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount_v2(self, count):
        count._obj.value = 3
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = 100 + index
        return 1 if index == 1 else 0

    def nvmlDeviceGetName(self, handle, name, length):
        name.value = f"Fake GPU {handle.value - 100}".encode()

    def nvmlDeviceGetMemoryInfo(self, handle, memory):
        memory[0], memory[1], memory[2] = 1000 * handle.value, 10 * handle.value, 0


def test_gpus_lists_every_gpu_nvml_has_a_handle_for(monkeypatch):
    fake = _FakeNvml()
    monkeypatch.setattr(cuda.ctypes, "CDLL", lambda name: fake)
    assert cuda.gpus() == [{"index": 0, "name": "Fake GPU 0", "memory_bytes": 100_000, "free_bytes": 1_000},
                           {"index": 2, "name": "Fake GPU 2", "memory_bytes": 102_000, "free_bytes": 1_020}]
    assert fake.shutdowns == 1


def test_the_device_accounting_has_three_parts(monkeypatch):
    from memsched.runtime import run

    monkeypatch.setattr(run, "fixed_overhead", lambda: {"bytes": 100, "source": "NVML", "reason": None})
    parts = run.device_accounting(1000, 1210)
    assert parts["accounted"] == {"arena_bytes": 1000, "pinned_store_device_bytes": 0, "fixed_overhead_bytes": 100,
                                  "total_bytes": 1100, "fixed_overhead_source": "NVML"}
    assert parts["measured_total_bytes"] == 1210 and parts["measured_over_accounted"] == pytest.approx(1.1)
    unmeasured = run.device_accounting(1000, None)
    assert unmeasured["measured_over_accounted"] is None and "not measured" in unmeasured["measured_source"]
    monkeypatch.setattr(run, "fixed_overhead", lambda: {"bytes": None, "source": None, "reason": "no CUDA"})
    parts = run.device_accounting(1000, 1210)
    assert parts["accounted"]["total_bytes"] is None and parts["accounted"]["fixed_overhead_source"] == "no CUDA"


@pytest.mark.parametrize("device", [[], ["--device", "cuda", "--allow-fallback"]])
def test_run_json_on_the_cpu_says_why_there_is_no_device_memory(tmp_path, device):
    from memsched.emit import write_plan
    from tests.conftest import run_cli
    from tests.planbuild import mlp_train_graph, order_plan

    if device and cuda.gpus():
        pytest.skip("a GPU is present: this checks the CPU-only answer")
    path = write_plan(order_plan(mlp_train_graph()), tmp_path / "plan.onnx")
    proc = run_cli("run", path, "--json", *device)
    assert proc.returncode == 0, proc.stderr
    process = json.loads(proc.stdout)["process"]
    assert process["device"] is None
    assert process["device_reason"].startswith("the run was on the CPU")


def test_a_device_memory_cap_bounds_the_cuda_providers_own_memory():
    from memsched import ort
    from memsched.errors import UserError

    try:
        ort.cap_cuda_memory(3 << 30)
        (_, options), _ = ort.providers_for("cuda")
        assert options["gpu_mem_limit"] == str(3 << 30)
        with pytest.raises(UserError, match="at least 1 byte"):
            ort.cap_cuda_memory(0)
    finally:
        ort.cap_cuda_memory(None)
    (_, options), _ = ort.providers_for("cuda")
    assert "gpu_mem_limit" not in options


def test_doctor_prints_the_fixed_overhead_it_measured(monkeypatch, capsys):
    report = {"onnxruntime": {"version": "1.31.1", "cuda_build": "13.0", "providers": ["CUDAExecutionProvider"]},
              "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 150 << 30, "free_bytes": 149 << 30}],
              "libraries": {}, "cuda_usable": True, "session_providers": ["CUDAExecutionProvider"],
              "device_memory": {"free_bytes": 149 << 30, "total_bytes": 150 << 30},
              "fixed_overhead": {"bytes": 600 << 20, "source": "NVML's figure for a process", "reason": None}}
    monkeypatch.setattr(doctor, "diagnose", lambda: report)
    assert cli.main(["doctor"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "fixed device memory per process: 600.00 MiB (629,145,600 B;" in text
