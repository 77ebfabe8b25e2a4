"""The host side of a training step: is the input pipeline hidden behind the device step?

One batch of D bytes is read from storage (bandwidth T1), preprocessed on the CPU, and sent
over the host link (bandwidth T2, shared with the plan's swap-ins). While the device runs
step i, the host prepares batch i+1, so the pipeline is hidden iff

    D / T1 + D / T2 + T_cpu <= T_gpu,          slack = T_gpu - (D / T1 + D / T2 + T_cpu).

Preprocessing cost from its memory traffic: each of the n calls a thread makes runs the
functions f (decode, resize, cast, ...), function f making alpha_f memory accesses of d bytes
each; an access costs the host memory latency L plus d / B at host bandwidth B, so

    T_cpu = n * sum_f(alpha_f) * (L + d / B)      [s = calls * accesses * (s + bytes / (bytes/s))]

Threads work in parallel, so the per-thread time is the batch's. Units: d in bytes, B in
bytes/s with GB = 10^9 (decimal, as memory bandwidth is quoted), L in seconds. The published
case (alpha = 439, 144, 116; d = 907,163 B; n = 5; B = 19 GB/s; L = 120 ns) then gives
5 * 699 * (120e-9 + 907163 / 19e9) = 3495 * 4.78654e-5 s = 0.1673 s, under EfficientNet's
0.2089 s step at batch 64; with GiB/s (2^30) it would be 0.1558 s, which is not the published
figure. At B = 10 GB/s, d / B alone is 90.7 us and T_cpu >= 0.3171 s for any L: never hidden.

The link is shared: swap-ins keep it busy `link_busy` seconds of the step (the simulator's h2d
stream), so the batch gets the rest, T2 = link_bw * (1 - link_busy / T_gpu).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError
from .hardware import Hardware


@dataclass(frozen=True)
class InputPipeline:
    batch_bytes: int               # D: read from storage and sent to the device, per batch
    storage_bw: float              # T1, bytes/s
    calls_per_thread: int          # n
    accesses: tuple[int, ...]      # alpha_f, memory accesses per call of each function
    access_bytes: int              # d, bytes per access


@dataclass(frozen=True)
class PipelineCheck:
    storage_s: float
    cpu_s: float
    link_s: float
    gpu_step_s: float
    host_bw: float
    host_latency: float

    @property
    def total_s(self) -> float:
        return self.storage_s + self.cpu_s + self.link_s

    @property
    def slack_s(self) -> float:
        return self.gpu_step_s - self.total_s

    @property
    def hidden(self) -> bool:
        return self.total_s <= self.gpu_step_s

    def to_dict(self) -> dict:
        return {"storage_s": self.storage_s, "cpu_s": self.cpu_s, "link_s": self.link_s, "total_s": self.total_s,
                "gpu_step_s": self.gpu_step_s, "slack_s": self.slack_s, "hidden": self.hidden,
                "host_bw": self.host_bw, "host_latency_s": self.host_latency}


def cpu_time(p: InputPipeline, host_bw: float, host_latency: float) -> float:
    """T_cpu = n * sum(alpha_f) * (L + d / B), seconds."""
    if host_bw <= 0 or host_latency < 0:
        raise UserError("host memory bandwidth must be positive and latency not negative")
    return p.calls_per_thread * sum(p.accesses) * (host_latency + p.access_bytes / host_bw)


def check(p: InputPipeline, gpu_step: float, link_bw: float, host_bw: float, host_latency: float,
          link_busy: float = 0.0) -> PipelineCheck:
    """Is the pipeline hidden behind a device step of `gpu_step` seconds?"""
    spare = 1.0 - link_busy / gpu_step if gpu_step > 0 else 0.0
    link_s = p.batch_bytes / (link_bw * spare) if spare > 0 else float("inf")
    if p.batch_bytes == 0:
        link_s = 0.0
    return PipelineCheck(storage_s=p.batch_bytes / p.storage_bw, cpu_s=cpu_time(p, host_bw, host_latency),
                         link_s=link_s, gpu_step_s=gpu_step, host_bw=host_bw, host_latency=host_latency)


def check_on(p: InputPipeline, hw: Hardware, gpu_step: float, link_busy: float = 0.0) -> PipelineCheck:
    """`check` with host memory = the profile's DRAM tier and the link = its h2d bandwidth."""
    dram = hw.tier("dram")
    return check(p, gpu_step, hw.link_h2d, dram.read_bw, dram.latency, link_busy)


def grid(p: InputPipeline, gpu_step: float, link_bw: float, bandwidths, latencies,
         link_busy: float = 0.0) -> list[list[PipelineCheck]]:
    """The check at every host memory (bandwidth, latency): rows by bandwidth, columns by latency."""
    return [[check(p, gpu_step, link_bw, b, lat, link_busy) for lat in latencies] for b in bandwidths]
