"""The CUDA libraries: which ones ONNX Runtime's CUDA provider needs, where they are, loading them.

onnxruntime-gpu's CUDA provider (`libonnxruntime_providers_cuda.so`) links the CUDA runtime,
cuBLAS and cuRAND by soname (its ELF `DT_NEEDED` entries, read here from the installed file,
so the list follows the installed build) and loads cuDNN at run time. The `[cuda]` extra of
memsched installs them as NVIDIA's pip wheels (`nvidia-cuda-runtime`, `nvidia-cublas`,
`nvidia-curand`, `nvidia-cudnn-cu13`), which put them under `site-packages/nvidia/*/lib`,
where the dynamic loader does not look: `preload()` asks ONNX Runtime to load them
(`onnxruntime.preload_dlls`) before the first session, and `load_cudart()` gives the
executor the same libcudart. `libcuda.so.1` comes with the NVIDIA driver, never from pip.

`locate()` says where each library is: the path the process has it loaded from (read from
/proc/self/maps), else the first match in the wheels' folders, else None.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import io
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

from .errors import UserError

DRIVER = "libcuda.so.1"
CUDNN = "libcudnn.so.9"      # loaded by the CUDA provider at run time (cuDNN 9), not linked
CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")
# library (soname up to ".so") -> the NVIDIA wheel that ships it, as the `[cuda]` extra lists them
WHEELS = {"libcudart": "nvidia-cuda-runtime", "libcublas": "nvidia-cublas", "libcublasLt": "nvidia-cublas",
          "libcurand": "nvidia-curand", "libcudnn": "nvidia-cudnn-cu13"}
# the system libraries every Linux process has; not worth reporting
_SYSTEM = ("libc.so", "libm.so", "libdl.so", "librt.so", "libpthread.so", "libstdc++.so", "libgcc_s.so", "ld-linux")


def provider_library() -> Path | None:
    """ONNX Runtime's CUDA provider library, where this build has one."""
    try:
        import onnxruntime
    except ImportError:
        return None
    path = Path(onnxruntime.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    return path if path.exists() else None


def elf_needed(path: str | Path) -> list[str]:
    """The DT_NEEDED sonames of a 64-bit little-endian ELF shared library, in file order."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != 6:                                  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for at in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, at)
            if tag == 0:                               # DT_NULL
                break
            if tag == 1:                               # DT_NEEDED
                end = data.index(b"\0", strtab_offset + value)
                names.append(data[strtab_offset + value:end].decode())
    return names


def required_libraries() -> list[str]:
    """The CUDA libraries the installed CUDA provider needs: its linked ones, the driver first,
    then cuDNN. Empty where this ONNX Runtime build has no CUDA provider."""
    library = provider_library()
    if library is None:
        return []
    linked = [name for name in elf_needed(library) if not name.startswith(_SYSTEM)]
    return [DRIVER] + [name for name in linked if name != DRIVER] + [CUDNN]


def wheel_library_dirs() -> list[str]:
    """The `nvidia/*/lib` folders of NVIDIA's pip wheels on sys.path (and one level deeper, as
    CUDA 13's wheels nest them), in sys.path order."""
    found: list[str] = []
    for root in sys.path:
        if not root or not os.path.isdir(os.path.join(root, "nvidia")):
            continue
        for pattern in ("nvidia/*/lib", "nvidia/*/*/lib"):
            found.extend(d for d in sorted(glob.glob(os.path.join(root, pattern))) if d not in found)
    return found


def loaded_libraries() -> dict[str, str]:
    """soname-like file name -> path of every shared library this process has mapped."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if path.startswith("/") and ".so" in path:
                    paths.setdefault(os.path.basename(path), path)
    except OSError:
        pass
    return paths


def loadable(name: str) -> bool:
    """Whether the shared library `name` loads in this process (the dynamic loader's search)."""
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def locate(names: list[str]) -> dict[str, str | None]:
    """Where each library is: loaded in this process, else in a wheel's folder, else None."""
    loaded = loaded_libraries()
    dirs = wheel_library_dirs()
    where: dict[str, str | None] = {}
    for name in names:
        path = loaded.get(name) or next((p for p in loaded.values() if os.path.basename(p).startswith(name)), None)
        if path is None:
            path = next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))), None)
        where[name] = path
    return where


# Every ONNX Runtime CUDA session keeps cuBLAS handles of its own, each with cuBLAS's default
# workspace. On an H200 each further session of a step took 153 MB of device memory with that
# default and 19 MB with a 128 KiB workspace (8 buffers of 16 KiB), at the same step time on
# the bundled ResNet-18, U-Net-2D and GPT-2 steps (bench/gpu_check.py's session_cost).
CUBLAS_WORKSPACE = ":16:8"


def small_cublas_workspace() -> str:
    """Give the cuBLAS handles this process makes from now on a small workspace
    (CUBLAS_WORKSPACE_CONFIG, CUBLAS_WORKSPACE), unless the variable is set already: a user's
    value wins. The value in force."""
    return os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@functools.cache
def preload() -> str | None:
    """Load the CUDA and cuDNN libraries of NVIDIA's wheels into the process (ONNX Runtime's
    `preload_dlls`, whose messages are captured), so a CUDA session and the executor find
    them; None, or the libraries that failed to load."""
    try:
        import onnxruntime
    except ImportError as exc:
        return str(exc)
    if not hasattr(onnxruntime, "preload_dlls"):
        return "this ONNX Runtime has no preload_dlls"
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            onnxruntime.preload_dlls(directory="")
    except Exception as exc:  # noqa: BLE001 - ORT raises whatever loading raised
        return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    failed = [line.split(":")[0].removeprefix("Failed to load ").strip()
              for line in said.getvalue().splitlines() if line.startswith("Failed to load")]
    return f"could not load {', '.join(failed)}" if failed else None


def load_cudart():
    """The CUDA runtime (ctypes), from the process, the wheels or the system; UserError if none."""
    preload()
    for name in CUDART_NAMES:
        for path in [name] + [os.path.join(d, name) for d in wheel_library_dirs()]:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    raise UserError("the CUDA runtime library (libcudart) was not found: pip install -e '.[cuda]'")


def device_memory(cudart) -> tuple[int, int]:
    """(free, total) device memory in bytes of the current device (cudaMemGetInfo)."""
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    status = cudart.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
    if status != 0:
        raise UserError(f"CUDA call cudaMemGetInfo failed with error {status}")
    return int(free.value), int(total.value)


def gpus() -> list[dict]:
    """Name and memory of every GPU the NVIDIA driver's NVML sees (empty without a driver)."""
    try:
        nvml = Nvml()
    except UserError:
        return []
    try:
        found = []
        for index in range(nvml.count()):
            try:
                handle = nvml.handle_of(index)
            except UserError:
                continue
            total, free, _ = nvml.memory(handle)
            found.append({"index": index, "name": nvml.name(handle), "memory_bytes": total, "free_bytes": free})
        return found
    finally:
        nvml.close()


class Nvml:
    """NVML, the NVIDIA driver's management library, for one GPU: the device memory in use on
    it and the device memory one process holds there, as the driver counts them (the CUDA
    context included, which cudaMemGetInfo inside a process cannot separate out). UserError
    where there is no driver. The other GPUs' figures come through `handle_of`."""

    class _ProcessInfo(ctypes.Structure):      # nvmlProcessInfo_v1_t
        _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong)]

    def __init__(self, index: int = 0):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            raise UserError("NVML (libnvidia-ml.so.1) is not here: no NVIDIA driver") from None
        if self.lib.nvmlInit_v2() != 0:
            raise UserError("NVML could not be initialised")
        try:
            self.handle = self.handle_of(index)
        except UserError:
            self.lib.nvmlShutdown()
            raise

    def count(self) -> int:
        """How many GPUs the driver sees (0 where it cannot say)."""
        count = ctypes.c_uint()
        return int(count.value) if self.lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else 0

    def handle_of(self, index: int) -> ctypes.c_void_p:
        """NVML's handle of GPU `index`; UserError where it sees none."""
        handle = ctypes.c_void_p()
        if self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            raise UserError(f"NVML sees no GPU {index}")
        return handle

    def memory(self, handle: ctypes.c_void_p | None = None) -> tuple[int, int, int]:
        """The GPU's device memory (this one's, or `handle`'s): (total, free, used) bytes, every
        process's together."""
        memory = (ctypes.c_ulonglong * 3)()
        self.lib.nvmlDeviceGetMemoryInfo(self.handle if handle is None else handle, memory)
        return int(memory[0]), int(memory[1]), int(memory[2])

    def used_bytes(self) -> int:
        """Device memory in use on the GPU, every process's together."""
        return self.memory()[2]

    def name(self, handle: ctypes.c_void_p | None = None) -> str:
        name = ctypes.create_string_buffer(96)
        self.lib.nvmlDeviceGetName(self.handle if handle is None else handle, name, 96)
        return name.value.decode(errors="replace")

    def process_bytes(self, pid: int) -> int | None:
        """Device memory process `pid` holds on the GPU; None where NVML lists no such process
        (it has made no CUDA context, or the driver counts it under another pid namespace)."""
        count = ctypes.c_uint(64)
        infos = (self._ProcessInfo * 64)()
        if self.lib.nvmlDeviceGetComputeRunningProcesses(self.handle, ctypes.byref(count), infos) != 0:
            return None
        return max((int(i.used) for i in infos[:count.value] if i.pid == pid), default=None)

    def driver_version(self) -> str:
        version = ctypes.create_string_buffer(96)
        self.lib.nvmlSystemGetDriverVersion(version, 96)
        return version.value.decode(errors="replace")

    def close(self) -> None:
        self.lib.nvmlShutdown()


# ---- the fixed per-process overhead ----------------------------------------------------------
NO_CUDA = "there is no usable CUDA device here (memsched doctor says why); the overhead is measured on a GPU"
_PROBE = "from memsched.cuda import overhead_probe; overhead_probe()"
_overhead: dict | None = None


def fixed_overhead(refresh: bool = False, timeout: float = 180.0) -> dict:
    """The device memory any process running plans on CUDA holds besides its plans' arenas:
    the CUDA context, one executor session's cuDNN and cuBLAS handles and workspaces, ONNX
    Runtime's own structures. Measured in a fresh subprocess (`overhead_probe`): NVML's figure
    for that process once it has made one CUDA session as the executor makes them and run it,
    else the GPU's used memory after less before. A plan's process needs its arena plus this
    (host-pinned stores take no device memory).

    {'bytes', 'source', 'process_bytes', 'device_growth_bytes', 'key', 'cached', 'reason'}:
    `bytes` None with the `reason` where it cannot be measured (no CUDA here). Measured once per
    process and kept in a file in the temp folder, keyed by the GPU, driver, ONNX Runtime and
    cuBLAS workspace setting, so the runs of one machine share one measurement; `refresh`
    measures again (memsched doctor does)."""
    global _overhead
    from .ort import resolve_device

    key = _overhead_key()
    if key is None or resolve_device("cuda")[0] != "cuda":
        return {"bytes": None, "source": None, "reason": NO_CUDA}
    path = Path(tempfile.gettempdir()) / f"memsched-fixed-overhead-{key}.json"
    if not refresh:
        if _overhead is not None and _overhead.get("key") == key:
            return _overhead
        with contextlib.suppress(OSError, ValueError):
            _overhead = {**json.loads(path.read_text()), "cached": str(path)}
            return _overhead
    _overhead = {**_run_probe(timeout), "key": key, "cached": None}
    if _overhead["bytes"] is not None:
        from .onnx_utils import write_text_atomic

        with contextlib.suppress(OSError):
            write_text_atomic(path, json.dumps(_overhead))
    return _overhead


def _overhead_key() -> str | None:
    """What the fixed overhead depends on, hashed: GPU 0's name and memory, the driver, ONNX
    Runtime's version, the cuBLAS workspace setting, the Python; None without a GPU."""
    import hashlib

    try:
        import onnxruntime
        nvml = Nvml()
    except (ImportError, UserError):
        return None
    try:
        name, total, driver = nvml.name(), nvml.memory()[0], nvml.driver_version()
    finally:
        nvml.close()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    text = json.dumps([name, total, driver, onnxruntime.__version__, workspace, sys.executable])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _run_probe(timeout: float) -> dict:
    """`overhead_probe` in a fresh interpreter: its measurement, or `bytes` None and why not."""
    import subprocess

    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired:
        return {"bytes": None, "source": None, "reason": f"the probe ran past {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        said = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"bytes": None, "source": None, "reason": f"the probe failed: {said[:200]}"}
    return json.loads(lines[-1])


def overhead_probe() -> None:
    """The subprocess side of `fixed_overhead`: the GPU's used memory (NVML) before this
    process touches CUDA; one CUDA session of a Conv -> MatMul model (so cuDNN and cuBLAS make
    their handles) made as the executor makes its sessions (memsched.ort.bound_session: the
    shared workspace arena, the small cuBLAS workspace) and run once; then NVML's figure for
    this process and the GPU's used memory again. Prints one JSON line."""
    from .ort import bound_session, handles_model

    nvml = Nvml()
    before = nvml.used_bytes()
    model, feeds = handles_model()
    session = bound_session(model, 1, "cuda")
    session.run(None, feeds)
    load_cudart().cudaDeviceSynchronize()
    own, growth = nvml.process_bytes(os.getpid()), nvml.used_bytes() - before
    nvml.close()
    print(json.dumps({
        "bytes": own if own is not None else growth,
        "source": ("NVML's figure for a process that made one executor CUDA session and ran it" if own is not None
                   else "NVML: the GPU's used memory after one executor CUDA session, less before"),
        "process_bytes": own, "device_growth_bytes": growth, "provider": session.get_providers()[0],
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"), "reason": None}))


__all__ = ["DRIVER", "CUDNN", "WHEELS", "provider_library", "elf_needed", "required_libraries", "wheel_library_dirs",
           "loaded_libraries", "locate", "preload", "load_cudart", "device_memory", "gpus", "Nvml",
           "fixed_overhead", "overhead_probe"]


class CudaStreams:
    """The few CUDA runtime calls the executor needs (ctypes over libcudart): pinned host
    buffers, the compute stream every session's kernels run on (ONNX Runtime's
    `user_compute_stream`), and async copies on two copy streams (d2h, h2d), each copy with an
    event and each ordered after the kernels issued before it (an event on the compute stream
    the copy stream waits for), so a swap-out never reads a tensor still being written and a
    swap-in never overwrites bytes a kernel still reads."""

    H2D, D2H, D2D = 1, 2, 3

    def __init__(self):
        self.lib = load_cudart()
        self.compute = self._stream()
        self.streams = {self.D2H: self._stream(), self.H2D: self._stream()}
        self.events: dict[int, ctypes.c_void_p] = {}
        self.computed = self._event()        # recorded on the compute stream before each copy
        self.pinned_buffers: list[ctypes.c_void_p] = []

    def _call(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise UserError(f"CUDA call {name} failed with error {status}")

    def _stream(self) -> ctypes.c_void_p:
        stream = ctypes.c_void_p()
        self._call("cudaStreamCreateWithFlags", ctypes.byref(stream), 1)    # cudaStreamNonBlocking
        return stream

    def _event(self) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._call("cudaEventCreateWithFlags", ctypes.byref(handle), 2)     # cudaEventDisableTiming
        return handle

    def pinned(self, nbytes: int) -> np.ndarray:
        ptr = ctypes.c_void_p()
        self._call("cudaHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 1)), 0)
        self.pinned_buffers.append(ptr)
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr.value))[:nbytes]

    def copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        """A blocking copy, after every kernel issued before it (a run bound to device memory
        may return before its kernels end, and the legacy default stream does not wait for
        the compute stream) and done on the device before it returns."""
        self._call("cudaStreamSynchronize", self.compute)
        self._call("cudaMemcpy", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes), kind)
        self.synchronize()

    def copy_async(self, dst: int, src: int, nbytes: int, kind: int, event: int) -> None:
        stream = self.streams[kind]
        self._call("cudaEventRecord", self.computed, self.compute)
        self._call("cudaStreamWaitEvent", stream, self.computed, 0)
        self._call("cudaMemcpyAsync", ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                   kind, stream)
        if event not in self.events:
            self.events[event] = self._event()
        self._call("cudaEventRecord", self.events[event], stream)

    def wait(self, events: list[int]) -> None:
        for e in events:
            if e in self.events:
                self._call("cudaEventSynchronize", self.events[e])

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        """A blocking fill, ordered as `copy`."""
        self._call("cudaStreamSynchronize", self.compute)
        self._call("cudaMemset", ctypes.c_void_p(ptr), byte, ctypes.c_size_t(nbytes))
        self.synchronize()

    def synchronize(self) -> None:
        self._call("cudaDeviceSynchronize")

    def close(self) -> None:
        self.lib.cudaDeviceSynchronize()
        for handle in [*self.events.values(), self.computed]:
            self.lib.cudaEventDestroy(handle)
        for stream in [*self.streams.values(), self.compute]:
            self.lib.cudaStreamDestroy(stream)
        for ptr in self.pinned_buffers:
            self.lib.cudaFreeHost(ptr)
        self.events.clear()
        self.pinned_buffers.clear()


class CudaArena:
    """The executor's arena as one CUDA allocation (`buffer`: an object with `data_ptr()` and
    `tensor_size_in_bytes()`, ONNX Runtime's OrtValue), its copies on `streams`
    (`CudaStreams`). The host arena of memsched/runtime/device.py has the same methods."""

    def __init__(self, buffer, nbytes: int, streams: "CudaStreams"):
        self.buffer, self.nbytes, self.streams = buffer, nbytes, streams
        self.base = buffer.data_ptr()
        self.stream = streams.compute.value      # the stream every session's kernels run on

    def allocated_bytes(self) -> int:
        return int(self.buffer.tensor_size_in_bytes()) if self.nbytes else 0

    def write(self, lo: int, data: np.ndarray) -> None:
        self.streams.copy(self.base + lo, data.ctypes.data, data.size, CudaStreams.H2D)

    def read(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty(hi - lo, dtype=np.uint8)
        self.streams.copy(out.ctypes.data, self.base + lo, hi - lo, CudaStreams.D2H)
        return out

    def move(self, lo: int, source_lo: int, source_hi: int) -> None:
        """The bytes at [source_lo, source_hi) to `lo`; cudaMemcpy's result is undefined where
        the two ranges overlap, so such a move goes through the host."""
        if lo < source_hi and source_lo < lo + (source_hi - source_lo):
            self.write(lo, self.read(source_lo, source_hi))
        else:
            self.streams.copy(self.base + lo, self.base + source_lo, source_hi - source_lo, CudaStreams.D2D)

    def fill(self, lo: int, hi: int, byte: int) -> None:
        self.streams.memset(self.base + lo, byte, hi - lo)

    def copy_out(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        self.streams.copy_async(store.ctypes.data, self.base + lo, hi - lo, CudaStreams.D2H, event)

    def copy_in(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        self.streams.copy_async(self.base + lo, store.ctypes.data, hi - lo, CudaStreams.H2D, event)

    def wait(self, events: list[int]) -> None:
        if events:
            self.streams.wait(events)

    def synchronize(self) -> None:
        self.streams.synchronize()

    def pinned(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer (a DRAM store the copy streams read and write)."""
        return self.streams.pinned(nbytes)

    def close(self) -> None:
        self.streams.close()
