"""`memsched doctor`: can this machine run plans on CUDA, and if not, why and what fixes it.

The checks run in the order a CUDA session needs them, and the first one that fails gives the
reason and its fix: an ONNX Runtime build with the CUDA provider (onnxruntime-gpu), the NVIDIA
driver (libcuda.so.1, which only a GPU machine has), the CUDA libraries the provider links
(memsched.cuda reads them from the installed provider; the `[cuda]` extra installs them as
wheels, loaded by ONNX Runtime's preload_dlls), and last a real session on a one-op model, whose
`get_providers()` says what ONNX Runtime really gave (it falls back to the CPU silently).

Where CUDA is usable it also measures the fixed device memory every process running plans
holds besides its plans' arenas (the CUDA context, cuDNN and cuBLAS handles, ONNX Runtime's
own structures; memsched.cuda.fixed_overhead), so a plan's budget can leave room for it; on a
machine without CUDA it says that this cannot be measured there.
"""
from __future__ import annotations

from . import cuda

CUDA_PROVIDER = "CUDAExecutionProvider"
FIX_BUILD = "pip install onnxruntime-gpu (it replaces the CPU-only onnxruntime package)"
FIX_DRIVER = "run on a machine with an NVIDIA GPU and its driver; memsched plans and runs on the CPU meanwhile"
FIX_LIBRARIES = "pip install -e '.[cuda]' (NVIDIA's CUDA 13 runtime, cuBLAS, cuRAND and cuDNN 9 wheels)"


def diagnose() -> dict:
    """What the CUDA path finds here: ONNX Runtime, libraries, GPUs, a probe session; with
    `cuda_usable` and, where it is not, the first `reason` and its `fix`."""
    from .ort import build, make_session, one_op_model, resolve_device

    runtime = build()
    providers = runtime["providers"]
    needed = cuda.required_libraries()
    preload_error = cuda.preload() if needed else None
    libraries = cuda.locate(needed)
    driver = cuda.loadable(cuda.DRIVER)
    report = {"onnxruntime": runtime,
              "libraries": libraries, "preload": preload_error or "ok", "gpus": cuda.gpus(),
              "session_providers": None, "cuda_usable": False, "reason": None, "fix": None}
    missing = [name for name, path in libraries.items() if path is None and name != cuda.DRIVER]
    if CUDA_PROVIDER not in providers:
        report.update(reason="this ONNX Runtime build has no CUDA execution provider", fix=FIX_BUILD)
    elif not driver:
        report.update(reason=f"no NVIDIA driver here ({cuda.DRIVER} cannot be loaded)", fix=FIX_DRIVER)
    elif missing:
        report.update(reason=f"CUDA libraries not found: {', '.join(missing)}", fix=FIX_LIBRARIES)
    else:
        device, reason = resolve_device("cuda")      # the executor's own verdict
        if device == "cuda":
            report["cuda_usable"] = True
            report["session_providers"] = make_session(one_op_model(), "cuda").get_providers()
            free, total = cuda.device_memory(cuda.load_cudart())
            report["device_memory"] = {"free_bytes": free, "total_bytes": total}
        else:
            report.update(reason=reason, fix=FIX_LIBRARIES)
    report["fixed_overhead"] = fixed_overhead(report)
    return report


def fixed_overhead(report: dict) -> dict:
    """The fixed device memory of a process that runs plans (memsched.cuda.fixed_overhead,
    measured afresh) where CUDA is usable; else `bytes` None and why it cannot be measured."""
    if report["cuda_usable"]:
        return cuda.fixed_overhead(refresh=True)
    return {"bytes": None, "source": None,
            "reason": f"cannot be measured on this machine: {report['reason']}; it needs a usable CUDA GPU"}


__all__ = ["CUDA_PROVIDER", "diagnose", "fixed_overhead"]
