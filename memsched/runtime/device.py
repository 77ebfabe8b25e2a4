"""The device side of a run: the arena (a numpy buffer on the CPU, one device allocation on
CUDA), the host tiers' stores (DRAM buffers, pinned on CUDA; NVDIMM a memory-mapped file),
the copies between them, and each segment's ONNX Runtime session bound at its arena offsets."""
import os
import re
import shutil
import tempfile

import numpy as np
import onnx

from ..errors import ScheduleError, UserError
from ..ir import Graph
from ..cuda import CudaArena, CudaStreams
from ..ort import bind_addresses, bound_session, device_buffer, node_providers
from ..memory import MemoryProfile
from .program import Hooks, Program, Segment, recut, segment_model, with_poison

POISON = 0xFF        # every float made of these bytes is a NaN
ALIGN = 64           # the arena's base address alignment


def adds_no_nodes(saved: str, names: set[str]) -> bool:
    """Whether the graph ONNX Runtime saved after partitioning (`optimized_model_filepath`)
    holds only the segment's own nodes: no copy between devices was added, which would run
    out of the segment's order. False where nothing was saved (nothing is assumed)."""
    try:
        nodes = onnx.load(saved, load_external_data=False).graph.node
    except Exception:  # noqa: BLE001 - unreadable or absent: assume nothing
        return False
    return {node.name for node in nodes} == names


class HostArena:
    """The executor's arena in host memory: one numpy buffer whose base is ALIGN-aligned; every
    copy is done when it returns. memsched.cuda.CudaArena has the same methods on a device."""

    stream = None                # no stream: ONNX Runtime runs the kernels on its own threads

    def __init__(self, nbytes: int):
        self._raw = np.empty(max(nbytes, 1) + ALIGN, dtype=np.uint8)
        skip = (-self._raw.ctypes.data) % ALIGN
        self.bytes = self._raw[skip:skip + nbytes]
        self.base = self.bytes.ctypes.data if nbytes else self._raw.ctypes.data

    def allocated_bytes(self) -> int:
        return int(self.bytes.nbytes)

    def write(self, lo: int, data: np.ndarray) -> None:
        self.bytes[lo:lo + data.size] = data

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.bytes[lo:hi].copy()

    def move(self, lo: int, source_lo: int, source_hi: int) -> None:
        self.bytes[lo:lo + source_hi - source_lo] = self.bytes[source_lo:source_hi]

    def fill(self, lo: int, hi: int, byte: int) -> None:
        self.bytes[lo:hi] = byte

    def copy_out(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        store[:] = self.bytes[lo:hi]

    def copy_in(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        self.bytes[lo:hi] = store

    def wait(self, events: list[int]) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def close(self) -> None:
        pass


def make_arena(device: str, nbytes: int):
    """The arena of a run on `device`: a HostArena on the CPU, a CudaArena (one allocation
    and the streams its copies run on) on CUDA."""
    if device == "cuda":
        streams = CudaStreams()
        return CudaArena(device_buffer(nbytes), nbytes, streams)
    return HostArena(nbytes)


class Runtime:
    """The arena, the tier stores and the session cache for one run on one device. `arena`:
    the arena to use instead of `make_arena`'s (tests run the CUDA one over host memory)."""

    def __init__(self, device: str, arena_bytes: int, threads: int, nvdimm_dir: str | None, tf32: bool = True,
                 arena=None):
        self.device = device
        self.tf32 = tf32                         # float32 kernels on CUDA may use TF32 tensor cores
        self.arena_bytes = arena_bytes
        self.threads = threads
        self.nvdimm_dir = nvdimm_dir
        self.sessions: list = []
        self.stored = 0                          # bytes of the host tiers' stores
        self._tmpdir: str | None = None          # the NVDIMM store's folder, where none was given
        self._saved_dir: str | None = None       # where ONNX Runtime saves a CUDA segment's graph
        self._mmaps: list = []
        self.host_values: dict[str, np.ndarray] = {}   # tensor -> value its readers read from host memory
        self.host_inputs: dict[str, np.ndarray] = {}   # ... of them, the inputs and views read in place
        self.host_reads: dict[str, list] = {}          # such a tensor -> (binding, session input) reading it
        self.memory = arena if arena is not None else make_arena(device, arena_bytes)
        self.base = self.memory.base
        # the arena's bytes where they are host memory (hooks and the last outputs are read
        # there in place), else None
        self.arena = self.memory.bytes if isinstance(self.memory, HostArena) else None

    def __enter__(self):
        return self

    def allocated_bytes(self) -> int:
        """The size of the arena allocation as the allocator reports it."""
        return self.memory.allocated_bytes()

    def __exit__(self, *exc):
        self.sessions.clear()
        self._mmaps.clear()   # the files are unlinked already; the mappings go with the last view
        self.memory.close()
        for directory in (self._tmpdir, self._saved_dir):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
        return False

    # -- sessions
    def bind(self, program: Program, graph: Graph, profile: MemoryProfile, hooks: Hooks) -> None:
        """Give each segment of a lowered program its session, bound at its arena offsets; a
        segment ONNX Runtime added nodes to is cut again for any order (`recut`). Then mark
        the bytes a checked run poisons after each item (`with_poison`)."""
        items = []
        for item in program.items:
            if isinstance(item, Segment) and not self.build(item, graph, exact=program.exact):
                parts = recut(program, item, graph, self.device == "cuda", hooks)
                for part in parts:
                    self.build(part, graph, exact=False)
                items.extend(parts)
            else:
                items.append(item)
        program.items = with_poison(items, program, profile)

    def build(self, segment: Segment, graph: Graph, exact: bool) -> bool:
        """Make the segment's session and bind its inputs and outputs at their arena offsets.

        With `exact`, the segment was cut for ONNX Runtime's priority order of the nodes as
        given: if ORT added nodes of its own (or keeps no record of its nodes) no session is
        kept and the answer is False."""
        model, inputs, outputs = segment_model(segment, graph)
        stream = self.memory.stream
        saved = None
        if exact and stream is not None:        # ONNX Runtime may add copies between devices
            if self._saved_dir is None:
                self._saved_dir = tempfile.mkdtemp(prefix="memsched-segments-")
            saved = f"{self._saved_dir}/segment.onnx"
        try:
            session = bound_session(model.SerializeToString(), self.threads, self.device, stream, saved, self.tf32)
        except Exception as exc:  # noqa: BLE001 - ORT raises several types; name the op
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            found = re.search(r"\bn(\d+)\b", message)
            op = segment.runs[int(found.group(1)) if found and int(found.group(1)) < len(segment.runs) else 0].op
            raise UserError(f"ONNX Runtime cannot run {op.op_type} node '{op.name}': "
                            f"{re.sub(r'^.*?] ', '', message)}") from None
        assigned = node_providers(session)
        names = {node.name for node in model.graph.node}
        if exact and (set(assigned) != names or len(segment.runs) == 0
                      or (saved is not None and not adds_no_nodes(saved, names))):
            return False
        def at(value: str, tensor: str, lo: int) -> tuple:
            t = graph.tensors[tensor]
            held = self.host_inputs.get(tensor)       # a view of an input read in place
            return value, t.dtype, t.shape, self.base + lo if held is None else held.ctypes.data

        host = {value: self.host_values[tensor] for value, tensor, _ in inputs if tensor in self.host_values}
        binding = bind_addresses(session, self.device, [at(*i) for i in inputs if i[0] not in host],
                                 [at(*o) for o in outputs], host)
        for value, tensor, _ in inputs:
            if tensor in self.host_inputs:
                self.host_reads.setdefault(tensor, []).append((binding, value))
        for j, run in enumerate(segment.runs):
            run.provider = assigned.get(f"n{j}", session.get_providers()[0])
        segment.session, segment.binding = session, binding
        self.sessions.append(session)
        return True

    # -- the host tiers
    def stores(self, sizes: dict[tuple[str, str], int]) -> dict[tuple[str, str], np.ndarray]:
        """One uint8 view per (tier, tensor): DRAM in host memory (pinned on CUDA), NVDIMM in a
        memory-mapped file in nvdimm_dir (a temp dir by default)."""
        views = {}
        for tier in sorted({tier for tier, _ in sizes}):
            items = sorted((t, n) for (tr, t), n in sizes.items() if tr == tier)
            total = sum(n for _, n in items)
            buffer = self._tier_buffer(tier, total)
            offset = 0
            for t, n in items:
                views[(tier, t)] = buffer[offset:offset + n]
                offset += n
        return views

    def _tier_buffer(self, tier: str, nbytes: int) -> np.ndarray:
        if tier == "nvdimm":
            directory = self.nvdimm_dir
            if directory is None:
                self._tmpdir = directory = tempfile.mkdtemp(prefix="memsched-nvdimm-")
            try:
                handle = tempfile.NamedTemporaryFile(dir=directory, prefix="memsched-", suffix=".nvdimm")
            except OSError as exc:
                raise UserError(f"cannot create the NVDIMM store in {directory}: {exc.strerror}") from None
            with handle:
                mm = np.memmap(handle.name, dtype=np.uint8, mode="w+", shape=(max(nbytes, 1),))
                try:      # the blocks now: a mapped sparse file past the free space dies of SIGBUS
                    os.posix_fallocate(handle.fileno(), 0, max(nbytes, 1))
                    full = None
                except OSError as exc:
                    full, mm = exc, None
            if full is not None:
                if self._tmpdir is not None:
                    shutil.rmtree(self._tmpdir, ignore_errors=True)
                    self._tmpdir = None
                raise UserError(f"cannot reserve {nbytes:,} bytes for the NVDIMM store in {directory}: "
                                f"{full.strerror or full}")
            self._mmaps.append(mm)
            self.stored += nbytes
            return mm
        if tier != "dram":
            raise ScheduleError(f"unknown host tier '{tier}' (tiers: dram, nvdimm)")
        self.stored += nbytes
        return self.memory.pinned(nbytes)

    # -- bytes in and out of the arena
    def write(self, lo: int, value: np.ndarray) -> None:
        self.memory.write(lo, np.ascontiguousarray(value).reshape(-1).view(np.uint8))

    def read(self, lo: int, hi: int) -> np.ndarray:
        return self.memory.read(lo, hi)

    def store_bytes(self) -> int:
        """Bytes of the host tiers' stores (DRAM and NVDIMM)."""
        return self.stored

    def fetch(self, place: tuple) -> np.ndarray:
        """A host copy of the bytes at `place` (('arena', lo, hi) or ('store', view))."""
        return self.read(place[1], place[2]) if place[0] == "arena" else np.array(place[1])

    def put(self, place: tuple, source) -> None:
        """Copy `source` (a place, or host bytes) to `place`; arena to arena stays on the device."""
        if place[0] == "store":
            place[1][:] = self.fetch(source) if isinstance(source, tuple) else source
        elif not isinstance(source, tuple) or source[0] == "store":
            self.write(place[1], source if not isinstance(source, tuple) else source[1])
        else:
            self.memory.move(place[1], source[1], source[2])

    def fill(self, lo: int, hi: int, byte: int) -> None:
        self.memory.fill(lo, hi, byte)

    def copy_out(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        self.memory.copy_out(lo, hi, store, event)

    def copy_in(self, lo: int, hi: int, store: np.ndarray, event: int) -> None:
        self.memory.copy_in(lo, hi, store, event)

    def wait(self, events: list[int]) -> None:
        self.memory.wait(events)

    def wait_all(self) -> None:
        self.memory.synchronize()

    def synchronize(self) -> None:
        self.wait_all()
