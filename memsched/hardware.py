"""Hardware profiles: what a device and its host can do, in bytes and seconds.

A `Hardware` holds the device's memory, its peak FLOP/s per dtype, its memory bandwidth, the
cost of launching one kernel, the host link (bandwidth per direction with pinned buffers,
and a latency per transfer) and the host tiers a plan may swap to (`dram`, `nvdimm`), each
with capacity, read/write bandwidth and latency. Units: bytes, seconds, bytes/s, FLOP/s.

Profiles come from the presets below (public spec figures, cited beside each number), from
the measured `cpu` preset (`memsched/profiles/cpu.json`, written by
`memsched hardware calibrate -o memsched/profiles/cpu.json`), or from a user TOML/JSON file
with the same keys as `Hardware.to_dict()` (`memsched hardware show a100-80gb --json` prints
one to start from). Sizes may be written as strings ('80GiB').

A transfer between the device and a host tier pays the link latency and the tier latency and
moves at the slower of the link and the tier: d2h (swap-out) writes the tier, h2d (swap-in)
reads it. So GPU<->NVDIMM is bounded by both.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .documents import read_document
from .errors import UserError
from .units import MAX_BYTES, parse_bytes

GB = 10**9          # bandwidths are quoted in decimal GB/s by every vendor
GiB = 2**30         # memory sizes in binary units, as GPUs and DIMMs are built
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


@dataclass(frozen=True)
class HostTier:
    """A host memory tier a plan swaps to. read_bw feeds swap-ins, write_bw absorbs swap-outs."""

    capacity: int       # bytes
    read_bw: float      # bytes/s
    write_bw: float     # bytes/s
    latency: float      # s, paid once per transfer


@dataclass(frozen=True)
class Hardware:
    """One device plus its host. `op_class_flops`/`op_class_bandwidth` override the peaks for an
    op class (see memsched.cost.OP_CLASSES); calibrated profiles fill them, spec sheets do not.

    A class with an `op_class_overhead` is priced by the line `memsched hardware calibrate`
    fitted to it (memsched.cost.fitted_time): overhead + FLOPs / its FLOP/s + bytes / its
    bandwidth + broadcast loops x `op_class_loop`, each term where the profile has the figure.
    Every other class is priced by the roofline: max(FLOPs / FLOP/s, bytes / bandwidth) plus
    `launch_overhead`."""

    name: str
    device_memory: int                  # bytes
    peak_flops: dict[str, float]        # numpy dtype name ('float32', 'float16', ...) -> FLOP/s
    memory_bandwidth: float             # device memory, bytes/s
    launch_overhead: float              # s per op (kernel launch / dispatch)
    link_h2d: float                     # host -> device, bytes/s (pinned)
    link_d2h: float                     # device -> host, bytes/s (pinned)
    link_latency: float                 # s per transfer
    tiers: dict[str, HostTier]
    description: str = ""
    op_class_flops: dict[str, float] = field(default_factory=dict)
    op_class_bandwidth: dict[str, float] = field(default_factory=dict)
    op_class_overhead: dict[str, float] = field(default_factory=dict)   # s per op of a fitted class
    op_class_loop: dict[str, float] = field(default_factory=dict)       # s per broadcast inner loop

    def has_class(self, op_class: str) -> bool:
        """Whether the profile has any figure of its own for `op_class`."""
        return any(op_class in d for d in (self.op_class_flops, self.op_class_bandwidth, self.op_class_overhead,
                                           self.op_class_loop))

    def flops_for(self, op_class: str, dtype: str) -> float:
        """Effective FLOP/s for an op class in a dtype: calibrated class figure, else the dtype peak."""
        if op_class in self.op_class_flops:
            return self.op_class_flops[op_class]
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def bandwidth_for(self, op_class: str) -> float:
        return self.op_class_bandwidth.get(op_class, self.memory_bandwidth)

    def tier(self, name: str) -> HostTier:
        if name not in self.tiers:
            raise UserError(f"hardware '{self.name}' has no host tier '{name}' "
                            f"(it has: {', '.join(self.tiers)})")
        return self.tiers[name]

    def transfer_time(self, nbytes: int, tier: str, direction: str) -> float:
        """Seconds to move `nbytes` between device and `tier`; direction 'd2h' or 'h2d'."""
        t = self.tier(tier)
        if direction == "d2h":
            bw = min(self.link_d2h, t.write_bw)
        elif direction == "h2d":
            bw = min(self.link_h2d, t.read_bw)
        else:
            raise ValueError(f"unknown transfer direction '{direction}'")
        return self.link_latency + t.latency + nbytes / bw

    def to_dict(self) -> dict:
        return asdict(self)


# ---- presets ---------------------------------------------------------------------------
# Host link, per direction, pinned memory. PCIe x16 raw rates after line encoding are
# 15.75 GB/s (Gen3), 31.5 GB/s (Gen4), 63 GB/s (Gen5); CUDA's bandwidthTest reaches about
# 12, 25 and 50 GB/s pinned on them, which is what a swap sees.
PCIE3, PCIE4, PCIE5 = 12 * GB, 25 * GB, 50 * GB
# Per transfer: cudaMemcpyAsync issue + DMA setup is ~10 us for small copies.
PCIE_LATENCY = 10e-6
# CUDA kernel launch overhead, ~5 us per kernel as commonly measured.
CUDA_LAUNCH = 5e-6
# Host DRAM load-to-use latency on server CPUs, ~90 ns.
DRAM_LATENCY = 90e-9


def optane_pmem(dimms: int = 6, dimm_capacity: int = 128 * GiB) -> HostTier:
    """Intel Optane DC PMem 100 in App Direct mode (Izraelevitz et al., 'Basic Performance
    Measurements of the Intel Optane DC Persistent Memory Module', 2019): one DIMM reads at
    ~6.6 GB/s and writes at ~2.3 GB/s, ~350 ns loaded latency; six interleaved DIMMs read at
    ~38 GB/s (not quite 6 x 6.6) and write at ~6 x 2.3 GB/s. Modules: 128/256/512 GB."""
    read = 38 * GB * dimms / 6 if dimms >= 6 else 6.6 * GB * dimms
    return HostTier(capacity=dimms * dimm_capacity, read_bw=read, write_bw=2.3 * GB * dimms,
                    latency=350e-9)


def _dram(capacity: int, bandwidth: float) -> HostTier:
    return HostTier(capacity=capacity, read_bw=bandwidth, write_bw=bandwidth, latency=DRAM_LATENCY)


def _gpu(name, memory, flops, bandwidth, link, dram, description) -> Hardware:
    return Hardware(name=name, device_memory=memory, peak_flops=flops, memory_bandwidth=bandwidth,
                    launch_overhead=CUDA_LAUNCH, link_h2d=link, link_d2h=link, link_latency=PCIE_LATENCY,
                    tiers={"dram": dram, "nvdimm": optane_pmem()}, description=description)


# NVIDIA Tesla V100 SXM2 datasheet: FP64 7.8, FP32 15.7, FP16 tensor 125 TFLOPS; HBM2 900 GB/s.
# Host: DGX-1, 2x Xeon E5-2698 v4 (4 ch DDR4-2400 = 76.8 GB/s per socket), 512 GB.
_V100_FLOPS = {"float64": 7.8e12, "float32": 15.7e12, "float16": 125e12}
_V100_HOST = _dram(512 * GiB, 76.8 * GB)
# NVIDIA A100 SXM4 datasheet: FP64 9.7, FP32 19.5, TF32 156, FP16/BF16 tensor 312 TFLOPS (dense);
# HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s (80GB).
# Host: DGX A100, 2x EPYC 7742 (8 ch DDR4-3200 = 204.8 GB/s per socket), 1 TB.
_A100_FLOPS = {"float64": 9.7e12, "float32": 19.5e12, "tf32": 156e12, "float16": 312e12, "bfloat16": 312e12}
_A100_HOST = _dram(1024 * GiB, 204.8 * GB)
# NVIDIA H100 SXM5 datasheet: FP64 34, FP32 67, TF32 494.5, FP16/BF16 989.5 TFLOPS (dense);
# HBM3 3.35 TB/s. H200 SXM: same compute, 141 GB HBM3e at 4.8 TB/s.
# Host: DGX H100/H200, 2x Xeon 8480C (8 ch DDR5-4800 = 307.2 GB/s per socket), 2 TB.
_H100_FLOPS = {"float64": 34e12, "float32": 67e12, "tf32": 494.5e12, "float16": 989.5e12, "bfloat16": 989.5e12}
_H100_HOST = _dram(2048 * GiB, 307.2 * GB)

PRESETS: dict[str, Hardware] = {
    hw.name: hw for hw in (
        _gpu("v100-16gb", 16 * GiB, _V100_FLOPS, 900 * GB, PCIE3, _V100_HOST, "NVIDIA V100 16 GB, PCIe 3"),
        _gpu("v100-32gb", 32 * GiB, _V100_FLOPS, 900 * GB, PCIE3, _V100_HOST, "NVIDIA V100 32 GB, PCIe 3"),
        _gpu("a100-40gb", 40 * GiB, _A100_FLOPS, 1555 * GB, PCIE4, _A100_HOST, "NVIDIA A100 40 GB, PCIe 4"),
        _gpu("a100-80gb", 80 * GiB, _A100_FLOPS, 2039 * GB, PCIE4, _A100_HOST, "NVIDIA A100 80 GB, PCIe 4"),
        _gpu("h100-80gb", 80 * GiB, _H100_FLOPS, 3350 * GB, PCIE5, _H100_HOST, "NVIDIA H100 SXM 80 GB, PCIe 5"),
        _gpu("h200", 141 * GiB, _H100_FLOPS, 4800 * GB, PCIE5, _H100_HOST, "NVIDIA H200 SXM 141 GB, PCIe 5"),
    )
}
MEASURED = ("cpu",)   # presets stored as files in PROFILE_DIR, measured on a machine

# the profile a plan is made for where none is named (compile, tune-batch, simulate, a plan
# written without one)
PLANNING_PROFILE = "v100-16gb"


def preset_names() -> list[str]:
    return [*PRESETS, *MEASURED]


def load(spec: "str | Hardware") -> Hardware:
    """A preset name, a measured preset name, or a path to a TOML/JSON profile."""
    if isinstance(spec, Hardware):
        return spec
    if spec in PRESETS:
        return PRESETS[spec]
    if spec in MEASURED:
        path = PROFILE_DIR / f"{spec}.json"
        if not path.exists():
            raise UserError(f"the '{spec}' profile has not been measured on this install; run "
                            f"`memsched hardware calibrate -o {path}`")
        return load_file(path)
    path = Path(spec)
    if path.suffix.lower() in (".toml", ".json") or path.exists():
        return load_file(path)
    raise UserError(f"unknown hardware '{spec}'; presets: {', '.join(preset_names())}, or give a .toml/.json file")


def load_file(path: str | Path) -> Hardware:
    path = Path(path)
    data = read_document(path, "hardware profile")
    return from_dict(data, default_name=path.stem, where=str(path))


_REQUIRED = ("device_memory", "peak_flops", "memory_bandwidth", "launch_overhead", "link_h2d", "link_d2h",
             "link_latency", "tiers")
_TIER_KEYS = ("capacity", "read_bw", "write_bw", "latency")


def from_dict(data: dict, default_name: str = "custom", where: str = "hardware profile") -> Hardware:
    """Build a Hardware from a dict (a parsed file), with one-line errors naming the bad key."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a table of keys")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise UserError(f"{where}: missing key(s) {', '.join(missing)}")
    # 'calibration': the timed rows a calibrated profile was fitted to, kept for the reader
    known = set(_REQUIRED) | {"name", "description", "op_class_flops", "op_class_bandwidth", "op_class_overhead",
                              "op_class_loop", "calibration"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}")
    tiers = {}
    if not isinstance(data["tiers"], dict) or not data["tiers"]:
        raise UserError(f"{where}: 'tiers' must name at least one host tier (dram, nvdimm)")
    for name, tier in data["tiers"].items():
        if not isinstance(tier, dict) or any(k not in tier for k in _TIER_KEYS):
            raise UserError(f"{where}: tier '{name}' needs {', '.join(_TIER_KEYS)}")
        tiers[name] = HostTier(capacity=_size(tier["capacity"], f"tiers.{name}.capacity", where),
                               read_bw=_positive(tier["read_bw"], f"tiers.{name}.read_bw", where),
                               write_bw=_positive(tier["write_bw"], f"tiers.{name}.write_bw", where),
                               latency=_nonneg(tier["latency"], f"tiers.{name}.latency", where))
    flops = _rates(data["peak_flops"], "peak_flops", where)
    if "float32" not in flops:
        raise UserError(f"{where}: peak_flops needs a 'float32' entry")
    return Hardware(
        name=str(data.get("name", default_name)),
        device_memory=_size(data["device_memory"], "device_memory", where),
        peak_flops=flops,
        memory_bandwidth=_positive(data["memory_bandwidth"], "memory_bandwidth", where),
        launch_overhead=_nonneg(data["launch_overhead"], "launch_overhead", where),
        link_h2d=_positive(data["link_h2d"], "link_h2d", where),
        link_d2h=_positive(data["link_d2h"], "link_d2h", where),
        link_latency=_nonneg(data["link_latency"], "link_latency", where),
        tiers=tiers,
        description=str(data.get("description", "")),
        op_class_flops=_rates(data.get("op_class_flops", {}), "op_class_flops", where),
        op_class_bandwidth=_rates(data.get("op_class_bandwidth", {}), "op_class_bandwidth", where),
        op_class_overhead=_times(data.get("op_class_overhead", {}), "op_class_overhead", where),
        op_class_loop=_times(data.get("op_class_loop", {}), "op_class_loop", where),
    )


# Sanity bounds: past them a figure is a typo, and sums of such times overflow to inf and NaN.
MAX_SECONDS = 60.0          # a launch, a transfer's latency
MIN_RATE, MAX_RATE = 1.0, 1e18      # FLOP/s and bytes/s


def _number(value, key: str, where: str) -> float:
    """A JSON/TOML number (not a string, not a bool), finite: 'Infinity' and 'NaN' parse but mean nothing here."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: '{key}' must be a number, not {value!r}")
    try:
        x = float(value)
    except OverflowError:         # an integer of hundreds of digits
        x = math.inf
    if not math.isfinite(x):
        raise UserError(f"{where}: '{key}' must be a finite number, not {value!r}")
    return x


def _positive(value, key: str, where: str) -> float:
    """A rate (FLOP/s, bytes/s): between MIN_RATE and MAX_RATE."""
    x = _number(value, key, where)
    if not MIN_RATE <= x <= MAX_RATE:
        raise UserError(f"{where}: '{key}' must be positive: a rate from {MIN_RATE:g} to {MAX_RATE:g} "
                        f"per second, not {value!r}")
    return x


def _nonneg(value, key: str, where: str) -> float:
    """A time in seconds: from 0 to MAX_SECONDS."""
    x = _number(value, key, where)
    if not 0 <= x <= MAX_SECONDS:
        raise UserError(f"{where}: '{key}' must be seconds from 0 to {MAX_SECONDS:g}, not {value!r}")
    return x


def _size(value, key: str, where: str) -> int:
    """Bytes, as a number or a string such as '80GiB'; above 0 and at most MAX_BYTES."""
    if isinstance(value, str):
        try:
            x = parse_bytes(value)
        except UserError as exc:
            raise UserError(f"{where}: '{key}': {exc}") from None
    else:
        x = int(_number(value, key, where))
    if not 0 < x <= MAX_BYTES:
        raise UserError(f"{where}: '{key}' must be a size above 0 and at most 1 EiB, not {value!r}")
    return x


def _rates(value, key: str, where: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise UserError(f"{where}: '{key}' must be a table of name = value")
    return {str(k): _positive(v, f"{key}.{k}", where) for k, v in value.items()}


def _times(value, key: str, where: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise UserError(f"{where}: '{key}' must be a table of name = seconds")
    return {str(k): _nonneg(v, f"{key}.{k}", where) for k, v in value.items()}
