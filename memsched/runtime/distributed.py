"""Data-parallel runs of a plan on torch.distributed: each worker runs the executor on its rows.

A plan compiled with `--data-parallel N` is one worker's step (memsched.data_parallel). Each of
the N ranks (processes) runs it with the bundled executor (memsched.runtime.run_plan) on its
shard of the batch: rank r takes rows r*b .. (r+1)*b of every per-sample input (b the per-worker
batch the plan records; the global batch is N*b). Ranks start from rank 0's weights: each
parameter and buffer (BatchNorm's running statistics) is broadcast from rank 0 just before the
first op that reads it in the first step, as DDP does when it wraps a module. BatchNorm in
training mode normalises with each rank's own batch statistics by default, and each rank keeps
its own running statistics from then on (DDP broadcasts rank 0's buffers before every forward
by default; here they are not synchronised after the start). With `sync_batchnorm` (as
torch's SyncBatchNorm), each BN's batch mean and variance are averaged across the ranks as
soon as they are computed, and so are the two per-channel sums of its backward pass
(`data_parallel.batch_statistics`): every rank then normalises with the whole batch's
statistics, and the step is the whole batch's step.
The gradients are averaged in place, in the arena: when the op that closes a bucket
(`gradient_buckets`) ends, each of the bucket's gradients is scaled by 1/N and all-reduced
(sum) with `dist.all_reduce(..., async_op=True)` on a torch tensor that is a zero-copy view of
its arena bytes (`torch.from_numpy`), and compute goes on; an op that reads a gradient (its
update) first waits for that bucket's work handles only. Gradients nothing reads in the step
(graph outputs) are waited for at its end. Nothing of the all-reduce is in the arena: gloo's
own buffers are outside the plan's bytes. Without overlap (`overlap=False`), closed buckets are
all-reduced only when an op needs one of them, and compute waits for all of them there.

Processes: `launch` starts N local ranks (`python -m memsched.runtime.distributed`, with torchrun's
environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT) and
collects rank 0's summary; under torchrun the same `run_rank` runs in each process torchrun
started. The backend is gloo (CPU): the executor's hooks hand out views of the CPU arena.
torch is imported here only, and only when a run starts (the `distributed` extra).

Measured per rank and step: the step time (the executor's, waits included), the time spent
waiting for all-reduces; after the steps, the buckets' all-reduces are timed alone (blocking,
on scratch tensors of the same sizes), so the overlap fraction is 1 - wait / all-reduce time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
from onnx import helper

from ..data_parallel import (INTERCONNECT, Bucket, batch_statistics, data_parallel, gradient_buckets,
                            per_sample_inputs, plan_options, readers)
from ..errors import MemschedError, UserError, first_line
from ..measure import prepare_inputs
from ..schedule import RUNS, Plan, StepKind
from .run import run_plan, steady_step_time

BACKEND = "gloo"
TIMEOUT_S = 300.0          # a rank that does not finish in this time fails the run
STORE_WAIT_S = 60.0        # a rank waits at most this long (or its timeout) for rank 0's store
LAUNCHER_PID = "MEMSCHED_LAUNCHER_PID"    # set in the ranks a local launcher starts (`tie_to_launcher`)
COMM_REPEATS = 3           # timed runs of the buckets' all-reduces alone (median)


def import_torch():
    """(torch, torch.distributed), or a UserError that names the extra to install."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise UserError("data-parallel runs need torch: pip install 'memsched[distributed]'") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise UserError("this torch build has no torch.distributed gloo backend; install a build that has")
    return torch, dist


def launched() -> bool:
    """Whether this process is a rank started by torchrun (or by `launch`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_plan(plan: Plan, workers: int) -> dict:
    """The plan's data-parallel options, where it was compiled for `workers` workers."""
    options = plan_options(plan.graph)
    if not options:
        raise UserError(f"the plan was compiled for one worker; compile it with --train --data-parallel {workers}")
    if options["workers"] != workers:
        raise UserError(f"the plan was compiled for {options['workers']} workers (--data-parallel), not {workers}")
    if not options["batch_inputs"]:
        raise UserError("the plan records no per-sample input to split among the workers")
    rows = options["worker_batch"]
    differ = sorted(set(per_sample_inputs(plan.graph, rows)) ^ set(options["batch_inputs"]))
    if differ:
        raise UserError(f"the plan's data-parallel record does not match its inputs at '{differ[0]}' (per-sample "
                        f"inputs have {rows} rows a worker); every rank would read the wrong rows: compile "
                        f"it again")
    swapped = sorted({s.target for s in plan.schedule if s.kind in (StepKind.SWAP_OUT, StepKind.FREE)
                      and plan.graph.tensors[s.target].kind == "param_grad"})
    if swapped:
        raise UserError(f"the plan moves gradient '{swapped[0]}' out of the arena before its update; a "
                        f"data-parallel run all-reduces gradients in place: compile without swap for it")
    return options


def global_inputs(plan: Plan, workers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Made-up inputs of the whole batch: rank r's rows are the executor's made-up inputs with seed
    seed + r; inputs that are not per-sample are the seed's."""
    options = plan_options(plan.graph)
    parts = [prepare_inputs(plan.graph, seed=seed + r) for r in range(workers)]
    return {name: np.concatenate([p[name] for p in parts]) if name in options["batch_inputs"] else parts[0][name]
            for name in parts[0]}


def shard(plan: Plan, inputs: dict[str, np.ndarray], rank: int, workers: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s rows of every per-sample input of the whole batch `inputs`; the rest as given."""
    options = plan_options(plan.graph)
    b = options["worker_batch"]
    result = dict(inputs)
    for name in options["batch_inputs"]:
        if name not in inputs:
            continue
        rows = np.asarray(inputs[name]).shape[0] if np.ndim(inputs[name]) else 0
        if rows % workers:
            raise UserError(f"input '{name}' has a batch of {rows}, which does not divide among {workers} workers")
        if rows != b * workers:
            raise UserError(f"input '{name}' has a batch of {rows}; the plan takes {b} rows per worker, "
                            f"{b * workers} in all")
        result[name] = np.ascontiguousarray(inputs[name][rank * b:(rank + 1) * b])
    return result


class _Comm:
    """The hooks of one rank's run: broadcast, bucket all-reduces, waits; and what they measured."""

    def __init__(self, plan: Plan, torch, dist, workers: int, overlap: bool, sync_batchnorm: bool = False):
        self.torch, self.dist, self.workers, self.overlap = torch, dist, workers, overlap
        graph = plan.graph
        statistics = set(batch_statistics(graph)) if sync_batchnorm else set()
        self.synchronised = len(statistics)
        self.buckets = gradient_buckets(plan, plan_options(graph)["bucket_bytes"])
        closing = {b.step: k for k, b in enumerate(self.buckets)}
        bucketed = {g for b in self.buckets for g in b.grads}
        self.scratch = {g: (graph.tensors[g].numel, helper.tensor_dtype_to_np_dtype(graph.tensors[g].dtype))
                        for g in bucketed}      # size and type of each gradient, for `measure`
        averaged = {}           # step -> the batch statistics its op makes (compute or recompute)
        makers = {}             # step -> the bucketed gradients its op makes
        first_read: dict[str, int] = {}          # parameter or buffer -> the step of its first reader
        last = 0                # the step of the last op
        for i, step in enumerate(plan.schedule):
            if step.kind not in RUNS:
                continue
            op, last = graph.op_by_name[step.target], i
            if made := [t for t in op.present_outputs if t in statistics]:
                averaged[i] = made
            if step.kind == StepKind.COMPUTE and (grads := [t for t in op.present_outputs if t in bucketed]):
                makers[i] = grads
            for t in op.present_inputs:
                if graph.tensors[t].kind in ("parameter", "buffer"):
                    first_read.setdefault(t, i)
        needs = readers(plan, self.buckets)
        broadcast: dict[int, list[str]] = {}
        for t, i in first_read.items():
            broadcast.setdefault(i, []).append(t)
        self.views: dict[str, np.ndarray] = {}
        self.works: dict[int, list] = {}         # bucket -> its all-reduces' work handles
        self.closed: list[int] = []              # closed, not yet started (without overlap)
        self.step = 0
        self.wait_s: list[float] = [0.0]

        def before(i):
            def hook(views):
                if self.step == 0 and i in broadcast:
                    for t in broadcast[i]:
                        self.dist.broadcast(self.torch.from_numpy(views[t]), src=0)
                if i in needs:
                    self.wait(needs[i])
            return hook

        def after(i):
            def hook(views):
                for t in averaged.get(i, ()):       # blocking: the next op reads them
                    self.average(views[t])
                for t in makers.get(i, ()):
                    self.views[t] = views[t]
                if i in closing:
                    self.close(closing[i])
                if i == last:
                    self.wait(range(len(self.buckets)))
                    self.step += 1
                    self.wait_s.append(0.0)
            return hook

        self.before = {i: before(i) for i in set(broadcast) | set(needs)}
        self.after = {i: after(i) for i in set(makers) | set(closing) | set(averaged) | {last}}

    def average(self, view: np.ndarray) -> None:
        """Replace `view` (bytes in the arena) by its mean over the ranks, now."""
        view *= view.dtype.type(1.0 / self.workers)
        self.dist.all_reduce(self.torch.from_numpy(view))

    def close(self, k: int) -> None:
        if not self.overlap:
            self.closed.append(k)
            return
        self.start(k)

    def start(self, k: int) -> None:
        works = []
        for g in self.buckets[k].grads:
            view = self.views.pop(g)
            view *= view.dtype.type(1.0 / self.workers)
            works.append(self.dist.all_reduce(self.torch.from_numpy(view), async_op=True))
        self.works[k] = works

    def wait(self, ks) -> None:
        """Wait for the all-reduces of buckets `ks` (without overlap: start every closed bucket's
        and wait for all of them)."""
        started = time.perf_counter()
        if not self.overlap:
            for k in self.closed:
                self.start(k)
            self.closed.clear()
            ks = list(self.works)
        for k in ks:
            for work in self.works.pop(k, ()):
                work.wait()
        self.wait_s[self.step] += time.perf_counter() - started

    def measure(self) -> float:
        """Seconds the buckets' all-reduces take alone (blocking, median of COMM_REPEATS)."""
        scratch = [[self.torch.from_numpy(np.zeros(*self.scratch[g])) for g in b.grads] for b in self.buckets]
        times = []
        for _ in range(COMM_REPEATS):
            self.dist.barrier()
            started = time.perf_counter()
            for tensors in scratch:
                for t in tensors:
                    self.dist.all_reduce(t)
            times.append(time.perf_counter() - started)
        return float(np.median(times))


def run_rank(plan: Plan, steps: int = 1, threads: int = 1, inputs: dict[str, np.ndarray] | None = None,
             overlap: bool = True, path: str | None = None, timeout: float = TIMEOUT_S,
             sync_batchnorm: bool = False) -> tuple[dict | None, dict]:
    """Run this process's rank of a data-parallel run (the environment torchrun sets names it);
    returns (the run's summary with every rank's figures on rank 0, None on the others; this
    rank's outputs). `inputs`: the
    whole batch (every rank is given the same), made up (`global_inputs`) where None.
    `sync_batchnorm`: BatchNorm on the whole batch's statistics (module doc)."""
    with rank_of(plan, overlap, sync_batchnorm, timeout) as (rank, workers, comm, dist):
        feeds = shard(plan, inputs if inputs is not None else global_inputs(plan, workers), rank, workers)
        result = run_plan(plan, steps=steps, device="cpu", inputs=feeds, threads=threads,
                          before=comm.before, after=comm.after)
        mine = {"rank": rank, "step_times_s": result.step_times, "allreduce_wait_s": comm.wait_s[:steps],
                "allreduce_s": comm.measure(), "peak_bytes": result.peak_bytes, "arena_bytes": result.arena_bytes,
                "provider": result.provider}
        ranks: list = [None] * workers
        dist.all_gather_object(ranks, mine)
    if rank != 0:                        # rank 0 reports the run
        return None, result.outputs
    summary = summarize(plan, path, ranks, result, comm.buckets, overlap, threads)
    summary["synchronised_batch_statistics"] = comm.synchronised
    return summary, result.outputs


def summarize(plan: Plan, path: str | None, ranks: list[dict], result, buckets: list[Bucket], overlap: bool,
              threads: int) -> dict:
    """The run's summary: measured (the slowest rank's median step) next to predicted (the
    data-parallel estimate on the `cpu` profile and the default interconnect)."""
    from ..hardware import load
    from ..simulate import simulate

    workers = len(ranks)
    estimate = data_parallel(plan, simulate(plan, load("cpu")), workers)
    exposed = estimate.exposed_comm_s if overlap else estimate.step_no_overlap_s - estimate.compute_s
    step = max(steady_step_time(r["step_times_s"]) for r in ranks)
    wait = float(np.mean([np.median(r["allreduce_wait_s"]) for r in ranks]))
    comm = float(np.mean([r["allreduce_s"] for r in ranks]))
    return {
        "plan": path, "workers": workers, "backend": BACKEND, "overlap": overlap, "steps": result.steps,
        "threads": threads, "provider": result.provider,
        "measured": {"peak_bytes": max(r["peak_bytes"] for r in ranks),
                     "per_worker_peak_bytes": [r["peak_bytes"] for r in ranks],
                     "arena_bytes": result.arena_bytes, "step_time_s": step, "allreduce_wait_s": wait,
                     "allreduce_s": comm, "overlap_fraction": min(1.0, max(0.0, 1 - wait / comm)) if comm > 0 else 1.0},
        "predicted": {"peak_bytes": result.planned_peak_bytes, "arena_bytes": result.planned_arena_bytes,
                      "step_time_s": estimate.step_overlap_s if overlap else estimate.step_no_overlap_s,
                      "step_overlap_s": estimate.step_overlap_s, "step_no_overlap_s": estimate.step_no_overlap_s,
                      "allreduce_wait_s": exposed, "allreduce_s": estimate.allreduce_s,
                      "overlap_fraction": 1 - exposed / estimate.allreduce_s if estimate.allreduce_s > 0 else 1.0,
                      "hardware": "cpu", "interconnect": {"bandwidth": INTERCONNECT[0], "latency_s": INTERCONNECT[1]}},
        "buckets": [{"op": b.op, "grads": list(b.grads), "bytes": b.nbytes} for b in buckets],
        "ranks": ranks,
    }


# ---- local processes -----------------------------------------------------------------------
@contextmanager
def rank_of(plan: Plan, overlap: bool = True, sync_batchnorm: bool = False, timeout: float = TIMEOUT_S):
    """This process's rank of a data-parallel run of `plan` (`run --workers`, `train --workers`,
    torchrun): yields (rank, world size, its `_Comm`: the step hooks that broadcast rank 0's
    weights at the start, all-reduce each bucket of gradients and wait for it, torch.distributed)
    with the process group up; tears it down after."""
    tie_to_launcher()
    torch, dist = import_torch()
    if not launched():
        raise UserError("not started as a rank: run under torchrun, or with --workers N")
    rank, workers = rank_and_world()
    check_plan(plan, workers)
    torch.set_num_threads(1)             # torch computes nothing here: the cores are ONNX Runtime's
    own = not dist.is_initialized()
    if own:
        address = _store_address()
        _reach_store(address, rank, min(timeout, STORE_WAIT_S))
        try:
            dist.init_process_group(BACKEND, timeout=timedelta(seconds=timeout))
        except (RuntimeError, ValueError) as exc:      # torch's DistError family: C++ frames follow its first line
            raise UserError(f"rank {rank} cannot join the process group at {address[0]}:{address[1]}: "
                            f"{first_line(exc)}") from None
    try:
        yield rank, workers, _Comm(plan, torch, dist, workers, overlap, sync_batchnorm), dist
    finally:
        if own:
            dist.destroy_process_group()


def _store_address() -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT, checked: where rank 0's store listens."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"MASTER_ADDR and MASTER_PORT must name rank 0's host and a TCP port 1-65535 "
                        f"(MASTER_ADDR={host!r}, MASTER_PORT={port!r})")
    return host, int(port)


def _reach_store(address: tuple[str, int], rank: int, wait: float) -> None:
    """Rank 0: the store's port must be free to listen on (unless torchrun's agent already
    hosts the store there). Other ranks: the store must answer within `wait` seconds (polled,
    so SIGTERM and Ctrl-C act at once), else one line."""
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        try:
            with socket.create_server(address, reuse_port=False):
                return
        except OSError as exc:
            raise UserError(f"rank 0 cannot listen on {address[0]}:{address[1]} for the process group: "
                            f"{exc.strerror or exc}; choose a free MASTER_PORT") from None
    end = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection(address, timeout=1.0):
                return
        except OSError as exc:
            if time.monotonic() >= end:
                raise UserError(f"rank {rank} cannot reach rank 0's store at {address[0]}:{address[1]} within "
                                f"{wait:g} s ({exc.strerror or exc}); is rank 0 running, and are MASTER_ADDR and "
                                f"MASTER_PORT its own?") from None
            time.sleep(0.2)


def tie_to_launcher() -> None:
    """In a rank `launch` or `launch_command` started: the kernel sends it SIGTERM when its
    launcher dies (Linux prctl PR_SET_PDEATHSIG), and a rank whose launcher is already gone
    stops, so no rank outlives a launcher that was killed. Set here, after exec, not between
    fork and exec (a `preexec_fn`), where Python code may deadlock in a launcher with threads
    (torch's) and hold the launcher in its wait for the exec."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or sys.platform != "linux":
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)       # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if str(os.getppid()) != launcher:
        raise UserError("the launcher that started this rank is gone")


def _start_rank(args: list[str], env: dict, **popen) -> subprocess.Popen:
    """One local rank's process (it ties itself to this launcher's life: `tie_to_launcher`)."""
    return subprocess.Popen(args, env=env, **popen)


def _rank_env(rank: int, workers: int, port: int) -> dict[str, str]:
    """The environment of local rank `rank` of `workers`, as torchrun sets it (loopback store)."""
    return {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(workers),
            "LOCAL_WORLD_SIZE": str(workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LAUNCHER_PID: str(os.getpid())}


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill the ranks still running and reap every one."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _wait(procs: list[subprocess.Popen], deadline: float | None = None) -> int | None:
    """Wait in short sleeps until every rank has ended or one failed: a Ctrl-C is then handled
    at once (the kernel may hand the signal to another thread than the main one, and a
    blocking wait there would not return to take it). Returns the first rank still running
    when `deadline` (a time.monotonic reading) passed, else None."""
    while any(p.poll() is None for p in procs) and not any(p.returncode for p in procs):
        if deadline is not None and time.monotonic() > deadline:
            return next(r for r, p in enumerate(procs) if p.poll() is None)
        time.sleep(0.05)
    return None


def _last_line(log, returncode: int) -> str:
    """A failed rank's reason: the last line it wrote (`log`, a file), else its exit status."""
    log.seek(0)
    lines = [line for line in log.read().strip().splitlines() if line.strip()]
    return lines[-1].replace("memsched: error: ", "") if lines else f"exit status {returncode}"


def rank_and_world() -> tuple[int, int]:
    """RANK and WORLD_SIZE from the environment torchrun sets; UserError where they are not a
    rank below a world size of at least 1."""
    try:
        rank, workers = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UserError(f"RANK and WORLD_SIZE must be whole numbers (RANK={os.environ.get('RANK')!r}, "
                        f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r})") from None
    if workers < 1 or not 0 <= rank < workers:
        raise UserError(f"RANK {rank} is no rank of a world of {workers} (0 .. WORLD_SIZE - 1)")
    return rank, workers


def launch_command(command: list[str], workers: int) -> int:
    """Run memsched's command line (`python -m memsched`) with arguments `command` as
    `workers` local ranks (loopback, gloo): rank 0's output is the command's, the others' is
    kept to name a failure. A rank that fails stops the others; returns rank 0's exit status,
    or raises UserError naming the rank that failed first."""
    if workers < 1:
        raise UserError(f"--workers needs at least 1 worker, not {workers}")
    import_torch()                        # the one-line error before any process starts
    port = free_port()
    procs, logs = [], []
    try:
        for rank in range(workers):
            log = tempfile.TemporaryFile(mode="w+") if rank else None      # a file: a pipe could fill and block
            logs.append(log)
            procs.append(_start_rank([sys.executable, "-m", "memsched", *command], _rank_env(rank, workers, port),
                                     stdout=subprocess.DEVNULL if rank else None, stderr=log, text=True))
        _wait(procs)
    finally:        # also on Ctrl-C and SIGTERM (cli.main's Terminated): no rank outlives the launcher
        _stop(procs)
    try:
        failed = [r for r, p in enumerate(procs) if p.returncode and p.returncode > 0]
        if failed and failed[0] != 0:
            raise UserError(f"rank {failed[0]} failed: {_last_line(logs[failed[0]], procs[failed[0]].returncode)}")
    finally:
        for log in logs[1:]:
            log.close()
    return procs[0].returncode if procs[0].returncode >= 0 else 1


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(plan_path: str, workers: int, steps: int = 1, threads: int = 1, inputs: str | None = None,
           outputs: str | None = None, overlap: bool = True, timeout: float = TIMEOUT_S,
           sync_batchnorm: bool = False) -> dict:
    """Start `workers` local ranks on `plan_path` (loopback, gloo) and return the run's summary.
    `inputs`: an .npz of the whole batch; `outputs`: a directory where each rank writes its
    outputs as rank<r>.npz. A rank that fails or runs past `timeout` seconds fails the run."""
    from ..emit import read_plan

    if workers < 1:
        raise UserError(f"--workers needs at least 1 worker, not {workers}")
    check_plan(read_plan(plan_path), workers)
    import_torch()                        # the one-line error before any process starts
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="memsched-dp-") as tmp, contextlib.ExitStack() as files:
        try:
            return _collect(procs, files, tmp, plan_path, workers, steps, threads, inputs, outputs, overlap,
                            timeout, sync_batchnorm)
        finally:     # also on Ctrl-C and SIGTERM: no rank outlives the launcher
            _stop(procs)


def _collect(procs: list, files: contextlib.ExitStack, tmp: str, plan_path: str, workers: int, steps: int,
             threads: int, inputs, outputs, overlap: bool, timeout: float, sync_batchnorm: bool) -> dict:
    """`launch`'s body: start the ranks (into `procs`, which the caller stops; their logs into
    `files`, which it closes) and gather them."""
    port = free_port()
    summary_path = Path(tmp) / "summary.json"
    logs = []
    for rank in range(workers):
        args = [sys.executable, "-m", "memsched.runtime.distributed", str(plan_path), "--steps", str(steps),
                "--threads", str(threads), "--timeout", str(timeout), "--summary", str(summary_path)]
        args += ["--inputs", str(inputs)] if inputs else []
        args += ["--outputs", str(outputs)] if outputs else []
        args += [] if overlap else ["--no-overlap"]
        args += ["--sync-batchnorm"] if sync_batchnorm else []
        log = files.enter_context(open(Path(tmp) / f"rank{rank}.log", "w+"))    # a file: a full pipe blocks
        logs.append(log)
        procs.append(_start_rank(args, _rank_env(rank, workers, port), stdout=log, stderr=subprocess.STDOUT,
                                 text=True))
    late = _wait(procs, time.monotonic() + timeout)
    if late is not None:
        raise UserError(f"rank {late} did not finish within {timeout:g} s; the data-parallel run was stopped")
    failed = [r for r, p in enumerate(procs) if p.returncode]
    if failed:
        raise UserError(f"rank {failed[0]} failed: {_last_line(logs[failed[0]], procs[failed[0]].returncode)}")
    return json.loads(summary_path.read_text())


def main(argv: list[str] | None = None) -> int:
    """One rank started by `launch`: run it, write rank 0's summary and each rank's outputs."""
    from ..emit import read_plan

    parser = argparse.ArgumentParser(prog="python -m memsched.runtime.distributed")
    parser.add_argument("plan")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S)
    parser.add_argument("--inputs")
    parser.add_argument("--outputs")
    parser.add_argument("--summary", required=True)
    parser.add_argument("--no-overlap", action="store_true")
    parser.add_argument("--sync-batchnorm", action="store_true")
    args = parser.parse_args(argv)
    try:
        inputs = dict(np.load(args.inputs)) if args.inputs else None
        summary, outputs = run_rank(read_plan(args.plan), args.steps, args.threads, inputs, not args.no_overlap,
                                    args.plan, args.timeout, args.sync_batchnorm)
    except MemschedError as exc:
        print(f"memsched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.outputs:
        np.savez(Path(args.outputs) / f"rank{os.environ['RANK']}.npz", **outputs)
    if summary is not None:
        Path(args.summary).write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
