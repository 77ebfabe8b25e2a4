"""ONNX Runtime plumbing shared by the executor and the profiler: session options, providers,
sessions that say in one line why they cannot be made, and where ORT put each node.

Two kinds of session are made here:
- `make_session`: a whole model as a user runs it (ONNX Runtime's default optimisations and
  memory arena), for numerics and inference;
- `session_options` / `bound_options` / `bound_session`: the executor's sessions and the
  reference run it is checked against. Both use the same optimisation level (OPTIMIZATION)
  and thread count, so every kernel is the same; the executor's own sessions also keep no
  arena of their own, because every tensor they touch is bound into the plan's arena and
  only kernels' scratch is left, which all of them take from one arena shared through ONNX
  Runtime's environment (`shared_scratch_arena`). The profiler times each op in such a
  session too (`op_session`), so what it measures is what a plan's run executes.
"""
from __future__ import annotations

import contextlib
import os
import re

import onnx

from .cuda import preload, small_cublas_workspace
from .errors import UserError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

# No graph optimisation in the executor's sessions, nor in the reference they are checked
# against. Even the basic level rewires data edges inside a segment -- a transpose of a
# transpose is cancelled, so its consumer reads the first input instead, and common
# subexpressions merge a recomputation into the op it replays -- and the plan reuses the
# bytes of tensors it knows to be dead by the order it wrote; once a node reads another
# tensor than the plan says, or a tensor is not written where the plan says, another tensor
# may already hold those bytes. What the basic level would gain is nothing here: the
# sessions have no initializers to fold and every tensor is a graph input or output, so no
# fusion applies. Speed comes from fewer, larger sessions and from threads instead.
OPTIMIZATION = "ORT_DISABLE_ALL"


def _error_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


@contextlib.contextmanager
def quiet_logger():
    """Silence ONNX Runtime's default logger while a provider is probed or a model loaded: a
    provider that fails to load logs a raw, coloured error there, and the caller says it in
    one line instead."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)  # ONNX Runtime's default: warnings


def check_threads(threads: int) -> None:
    """UserError unless `threads` is 0 (every core) up to the cores this process may use: ONNX
    Runtime starts every thread it is asked for (5,000 of them never finished a step; 100,000
    ended in a native crash)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not 0 <= threads <= cores:
        raise UserError(f"--threads must be 0 (every core) to {cores} (the cores here), not {threads}")


def session_options(threads: int, optimization: str = OPTIMIZATION):
    """The options of the executor's sessions and of the reference, so kernels and threading
    match. `threads` 0 lets ONNX Runtime use every core (its default); its pool's idle threads
    spin between kernels, as they do by default: parked after each kernel, they made a step
    at every core 1.13-1.32x slower (ResNet-18, BERT, GPT-2, MobileNetV2 at their small sizes,
    one session each)."""
    import onnxruntime as ort

    check_threads(threads)
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, optimization)
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return options


# The arenas every bound session shares for kernels' scratch, on the CPU and on CUDA: no cap,
# grown by exactly what a kernel asks for (arena_extend_strategy 1: kSameAsRequested).
SHARED_ARENA = {"max_mem": 0, "arena_extend_strategy": 1, "initial_chunk_size_bytes": 1 << 20,
                "max_dead_bytes_per_chunk": 1 << 20}
_scratch_registered = False


def shared_scratch_arena() -> None:
    """Register, once per process, a CPU arena in ONNX Runtime's environment that every session
    made with `bound_options` takes kernels' scratch (im2col and column buffers) from.

    Why one arena for all: without an arena each scratch buffer is malloc'd and freed per run,
    and a large one is a fresh mapping each time, so every run pays page faults on it (a 3-D
    U-Net step ran 1.3x slower than one plain session, which keeps its arena); with an arena
    per session, each session would keep its own scratch. The shared arena grows by regions of
    exactly the size a kernel asks for when none of its free regions holds the request
    (kSameAsRequested; reserving one large region up front instead costs 1/32 of its size in
    chunk bookkeeping, resident at once), and keeps them, so from the second step on no
    scratch is mapped or faulted in again. What stays resident is the scratch of the largest
    kernels in the order they first ran: a request larger than every free region gets a
    region of its own, so at most the sum of the increasing sizes asked for, and at least the
    largest single one."""
    global _scratch_registered
    if _scratch_registered:
        return
    import onnxruntime as ort

    config = ort.OrtArenaCfg(SHARED_ARENA)
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, config)
    _scratch_registered = True


def bound_options(threads: int):
    """`session_options` for a session whose tensors all live in memory the caller binds: no
    CPU arena of its own (kernels' scratch comes from `shared_scratch_arena`), no memory
    pattern (there is nothing for it to plan), and the priority-based node order (Kahn's
    algorithm over the nodes as given, Shape and Size nodes first when ready), which keeps the
    caller's order wherever data edges allow it."""
    import onnxruntime as ort

    shared_scratch_arena()
    options = session_options(threads)
    options.enable_cpu_mem_arena = False
    options.enable_mem_pattern = False
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    options.add_session_config_entry("session.use_env_allocators", "1")
    return options


_warm = False


def one_op_model(op_type: str = "Identity") -> onnx.ModelProto:
    """A model of one unary op on one float (x -> y), the least a session can be made for: to
    warm ONNX Runtime up, or to ask a provider whether it really runs here."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node(op_type, ["x"], ["y"])], op_type.lower(),
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def handles_model() -> tuple[bytes, dict]:
    """A small Conv -> Reshape -> MatMul model (serialized) and seeded inputs for it: the least
    that makes a CUDA session create its cuDNN and cuBLAS handles and workspaces when it runs,
    for measuring what a session costs in device memory (memsched.cuda.fixed_overhead,
    bench/gpu_check.py's session_cost)."""
    import numpy as np
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "shape"], ["r"]),
             helper.make_node("MatMul", ["r", "m"], ["y"])]
    graph = helper.make_graph(
        nodes, "handles",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 32, 32]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [16, 16, 3, 3]),
         helper.make_tensor_value_info("m", TensorProto.FLOAT, [1024, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 256])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [64, 1024])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 16, 32, 32), np.float32),
             "w": rng.standard_normal((16, 16, 3, 3), np.float32),
             "m": rng.standard_normal((1024, 256), np.float32)}
    return model.SerializeToString(), feeds


def warm_environment() -> None:
    """Make ONNX Runtime's environment and page in its session code, once per process: one
    one-node session, run once. What this costs (about 7 MiB of the library's code, resident
    from then on) any ONNX Runtime user pays before a first step; measurements of a step start
    after it, so that it counts for neither side."""
    global _warm
    if _warm:
        return
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(one_op_model("Relu").SerializeToString(), providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.zeros(1, np.float32)})
    _warm = True


def bound_session(model: bytes, threads: int, device: str, stream: int | None = None, saved: str | None = None,
                  tf32: bool = True):
    """A session for a model whose every tensor the caller binds (`bound_options`). On CUDA,
    `stream`: the address of the CUDA stream its kernels run on (every session of a run
    shares it), and kernels' workspace comes from one CUDA arena shared by all sessions
    (`shared_cuda_arena`). `saved`: a path ONNX Runtime writes the graph to as it will run
    it, its own added nodes included. `tf32`: as `providers_for`."""
    import onnxruntime as ort

    options = bound_options(threads)
    if device == "cuda":
        shared_cuda_arena()
    if saved is not None:
        options.optimized_model_filepath = saved
    return ort.InferenceSession(model, options, providers=providers_for(device, stream, tf32))


cuda_arena_state: str | None = None     # None until a CUDA session is made: "shared", or why not


def shared_cuda_arena() -> None:
    """Register, once per process, a CUDA arena in ONNX Runtime's environment that every bound
    session (`session.use_env_allocators`) takes kernels' workspace from, as on the CPU
    (`shared_scratch_arena`): without it each of a run's sessions keeps a CUDA arena of its
    own, and their sum, not the largest workspace, stays allocated. It grows by what is asked
    (kSameAsRequested). Where this ONNX Runtime cannot register one, sessions keep their own
    and `cuda_arena_state` says why."""
    global cuda_arena_state
    if cuda_arena_state is not None:
        return
    import onnxruntime as ort

    config = ort.OrtArenaCfg({**SHARED_ARENA, "max_mem": int(CUDA_OPTIONS.get("gpu_mem_limit", 0))})
    info = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    try:
        ort.create_and_register_allocator_v2("CUDAExecutionProvider", info, {"device_id": "0"}, config)
        cuda_arena_state = "shared"
    except Exception as exc:  # noqa: BLE001 - an older build or no CUDA: each session keeps its own arena
        cuda_arena_state = f"not shared: {_error_line(exc)}"


def reference_session(model: bytes, threads: int, device: str, tf32: bool = True):
    """The plain session the executor's run is checked against: the executor's optimisation
    level, thread count (`session_options`) and kernels' precision (`tf32`), ONNX Runtime's
    own memory arena and planner."""
    import onnxruntime as ort

    return ort.InferenceSession(model, session_options(threads), providers=providers_for(device, tf32=tf32))


def resolve_device(device: str) -> tuple[str, str | None]:
    """'cuda' when a CUDA arena, the CUDA runtime and a CUDA session can really be made here,
    else 'cpu' and the reason in one line: the verdict the executor runs by and doctor reports."""
    if device == "cpu":
        return "cpu", None
    import onnxruntime as ort

    from .cuda import load_cudart

    if PROVIDERS["cuda"] not in ort.get_available_providers():
        return "cpu", "this ONNX Runtime build has no CUDA execution provider"
    with quiet_logger():   # the reason is reported once, here
        try:
            device_buffer(1)
            load_cudart()
            session = ort.InferenceSession(one_op_model().SerializeToString(), session_options(1),
                                           providers=providers_for("cuda"))
            if PROVIDERS["cuda"] not in session.get_providers():    # ORT dropped it (libraries missing)
                return "cpu", "ONNX Runtime could not register its CUDA execution provider here"
        except Exception as exc:  # noqa: BLE001 - any failure means no usable CUDA
            reason = re.sub(r"^.*\) ", "", str(exc).strip().splitlines()[-1])   # drop ORT's source location
            return "cpu", f"CUDA is not usable here: {reason[:160]}"
    return "cuda", None


def version() -> str:
    """The ONNX Runtime version the reports name."""
    import onnxruntime as ort

    return ort.__version__


def build() -> dict:
    """What this ONNX Runtime is: {'version', 'providers' (the execution providers it was
    built with), 'cuda_build' (the CUDA version of a CUDA build, else None)}."""
    import onnxruntime as ort

    return {"version": version(), "providers": ort.get_available_providers(),
            "cuda_build": getattr(ort, "cuda_version", None) or None}


def probe_session(model: bytes):
    """A CPU session of `model` with no graph optimisation and errors kept quiet, to learn
    shapes from one run; None where ONNX Runtime cannot load it (the caller says what stayed
    unknown)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - ORT raises its own exception types
        return None


def device_buffer(nbytes: int):
    """`nbytes` of CUDA device memory (device 0) as an OrtValue; its address is `.data_ptr()`."""
    import numpy as np
    import onnxruntime as ort

    return ort.OrtValue.ortvalue_from_shape_and_type([max(nbytes, 1)], np.uint8, "cuda", 0)


def bind_addresses(session, device: str, inputs: list, outputs: list, host: dict | None = None):
    """An IOBinding of `session` whose inputs and outputs live at given addresses on `device`:
    each a (name, dtype, shape, address); ONNX Runtime allocates none of them. `host`: inputs
    bound from host arrays instead, by name (the arrays must outlive the binding)."""
    binding = session.io_binding()
    kind = "cuda" if device == "cuda" else "cpu"
    for name, dtype, shape, address in inputs:
        binding.bind_input(name, kind, 0, dtype, list(shape), address)
    for name, value in (host or {}).items():
        binding.bind_cpu_input(name, value)
    for name, dtype, shape, address in outputs:
        binding.bind_output(name, kind, 0, dtype, list(shape), address)
    return binding


def bind_values(session, device: str, feeds: dict, outputs: list):
    """An IOBinding of `session` with `feeds` copied to `device` once and outputs of the given
    (name, shape, dtype) allocated there once, so a timed run moves no data."""
    import onnxruntime as ort

    kind = "cuda" if device == "cuda" else "cpu"
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, kind, 0))
    for name, shape, dtype in outputs:
        binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, kind, 0))
    return binding


# The CUDA provider's own memory is bounded: every tensor is bound into the plan's arena, so
# the provider allocates only kernels' workspace; its arena grows by what is asked, not by
# doubling, and cuDNN picks convolution algorithms without its largest workspaces.
CUDA_OPTIONS = {"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC", "arena_extend_strategy": "kSameAsRequested",
                "cudnn_conv_use_max_workspace": "0"}


def cap_cuda_memory(limit_bytes: int | None) -> None:
    """Bound what ONNX Runtime's CUDA provider may allocate for itself (kernels' workspace;
    every tensor of a plan is bound into its arena) to `limit_bytes`: the `gpu_mem_limit` of
    every CUDA session made from now on and the `max_mem` of the workspace arena the executor's
    sessions share, if it is not registered yet. None lifts the bound. A process that runs
    under a device-memory cap (bench/gpu_cap.py) calls it before its first session."""
    if limit_bytes is None:
        CUDA_OPTIONS.pop("gpu_mem_limit", None)
    elif limit_bytes < 1:
        raise UserError(f"the CUDA provider's memory limit must be at least 1 byte, not {limit_bytes}")
    else:
        CUDA_OPTIONS["gpu_mem_limit"] = str(int(limit_bytes))


def providers_for(device: str, stream: int | None = None, tf32: bool = True) -> list:
    """The provider list of the executor's sessions on `device` (CUDA falls back to the CPU
    node by node, as ONNX Runtime assigns them). For CUDA, the cuBLAS workspace is made small
    (memsched.cuda.small_cublas_workspace) and NVIDIA's wheels' libraries are loaded
    (memsched.cuda.preload) before the first session; `stream` is the address of the CUDA
    stream the kernels run on (ONNX Runtime's `user_compute_stream`; its own where None);
    `tf32` False keeps float32 matrix products and convolutions off TF32 tensor cores."""
    if device == "cuda":
        small_cublas_workspace()
        preload()
        options = {**CUDA_OPTIONS, **({"user_compute_stream": str(stream)} if stream is not None else {})}
        if not tf32:
            options["use_tf32"] = "0"
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def make_session(model: onnx.ModelProto, device: str = "cpu", threads: int = 0):
    """An InferenceSession of `model` on `device` with ONNX Runtime's default optimisations and
    memory arena, as a user runs it; UserError if ORT cannot load it or fell back elsewhere."""
    import onnxruntime as ort

    check_threads(threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return _checked_session(model, options, device)


def op_session(model: onnx.ModelProto, device: str = "cpu", threads: int = 0):
    """A session of a model whose every tensor the caller binds, made as the executor makes
    its own (`bound_options`: no graph optimisation, no arena of its own, kernels' scratch
    from the shared arena): what the profiler times an op in, so a measured op is the kernel
    a plan's run executes (on CUDA: the executor's provider options). UserError as
    `make_session`."""
    return _checked_session(model, bound_options(threads), device, executors=True)


def _checked_session(model: onnx.ModelProto, options, device: str, executors: bool = False):
    """The session on `device`'s provider alone, or with `executors` on the executor's provider
    list and options (`providers_for`); UserError where it cannot be made or fell back."""
    import onnxruntime as ort

    if device not in PROVIDERS:
        raise UserError(f"unknown device '{device}'; use cpu or cuda")
    wanted = PROVIDERS[device]
    if wanted not in ort.get_available_providers():
        raise UserError(f"ONNX Runtime here has no {wanted}; profile with --device cpu")
    if device == "cuda":
        preload()
    with quiet_logger():
        try:
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=providers_for(device) if executors else [wanted])
        except Exception as exc:  # noqa: BLE001 - ORT raises its own exception types
            raise UserError(f"ONNX Runtime cannot load the model: {_error_line(exc)}") from None
    if session.get_providers()[0] != wanted:
        raise UserError(f"ONNX Runtime cannot run on {device} here (it fell back to {session.get_providers()[0]}; "
                        f"its CUDA libraries are missing or there is no GPU)")
    return session


def node_providers(session) -> dict[str, str]:
    """Node name -> the execution provider ONNX Runtime assigned it to (not the Casts or copies
    it added around nodes); empty where this ONNX Runtime keeps no assignment records."""
    try:
        return {node.name: subgraph.ep_name for subgraph in session.get_provider_graph_assignment_info()
                for node in subgraph.get_nodes()}
    except (AttributeError, RuntimeError):
        return {}


__all__ = ["PROVIDERS", "CUDA_OPTIONS", "OPTIMIZATION", "quiet_logger", "session_options", "bound_options",
           "bound_session", "shared_cuda_arena", "reference_session", "resolve_device", "shared_scratch_arena",
           "warm_environment",
           "one_op_model", "handles_model", "cap_cuda_memory", "providers_for", "make_session", "op_session",
           "node_providers", "version", "build",
           "probe_session",
           "device_buffer", "bind_addresses", "bind_values"]
