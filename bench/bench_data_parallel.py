"""Data-parallel runs on torch.distributed (gloo, loopback) with 1, 2 and 4 ranks on the CPU.

For each model (an MLP and a small CNN without BatchNorm, one global batch) and each number of
workers N, the training step is compiled with `--data-parallel N` (each worker's step takes 1/N
of the batch; hardware `cpu`) and run by `memsched.runtime.distributed.launch` on N local processes,
with the all-reduces overlapped with the backward and without (all of them after it), the two
alternating `--repeats` times (the run with the lowest step time of each kept: the machine's other
load only adds time). Reported per run: the slowest rank's median step time, the time waiting
for all-reduces, the buckets' all-reduce time alone, the overlap fraction (1 - wait / all-reduce
time), the measured and planned per-worker peaks (equal, exactly), and the estimate's figures
(`cpu` profile, the default interconnect). The ranks share this machine's cores: with more ranks
than cores, compute and communication compete, and the times say so. Times are compared only as
ratios within this run.

    PYTHONPATH=<torch> python bench/bench_data_parallel.py [--workers 1,2,4] [--steps 30] [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402

from memsched import models  # noqa: E402
from memsched.runtime.distributed import launch  # noqa: E402
from memsched.emit import write_plan  # noqa: E402
from memsched.models.cnn import plain_cnn  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402

BATCH = 64          # the global batch, divided among the workers


MODELS = {"mlp": lambda batch: models.build("mlp", batch=batch, hidden=[512, 256]),
          "small_cnn": lambda batch: plain_cnn(batch=batch)}
# bucket sizes that give each model several buckets (2.1 MB and 22 KB of gradients), so some can hide
BUCKET_BYTES = {"mlp": 256 * 1024, "small_cnn": 8 * 1024}


def bench(name: str, workers: int, steps: int, threads: int, bucket_bytes: int, repeats: int, tmp: Path) -> dict:
    source = tmp / f"{name}.onnx"
    onnx.save(MODELS[name](BATCH), str(source))
    result = compile_plan(source, train=True, data_parallel=workers, bucket_bytes=bucket_bytes,
                          hardware="cpu", time_limit=5, strategies="order,reuse")
    path = write_plan(result.plan, tmp / f"{name}-{workers}.onnx")
    tries: dict[str, list] = {"overlap": [], "no_overlap": []}
    for _ in range(repeats):
        for mode, found in tries.items():
            found.append(launch(str(path), workers, steps=steps, threads=threads, overlap=mode == "overlap"))
    runs = {mode: min(found, key=lambda s: s["measured"]["step_time_s"]) for mode, found in tries.items()}
    row = {"model": name, "workers": workers, "worker_batch": BATCH // workers, "bucket_bytes": bucket_bytes,
           "buckets": len(runs["overlap"]["buckets"]),
           "gradient_bytes": sum(b["bytes"] for b in runs["overlap"]["buckets"])}
    for mode, summary in runs.items():
        m, p = summary["measured"], summary["predicted"]
        row[mode] = {"measured": {k: m[k] for k in ("step_time_s", "allreduce_wait_s", "allreduce_s",
                                                     "overlap_fraction", "peak_bytes")},
                     "predicted": {k: p[k] for k in ("step_time_s", "allreduce_wait_s", "allreduce_s",
                                                     "overlap_fraction", "peak_bytes")}}
    o, n = row["overlap"], row["no_overlap"]
    row["step_ratio_overlap_to_none"] = {
        "measured": o["measured"]["step_time_s"] / n["measured"]["step_time_s"],
        "predicted": o["predicted"]["step_time_s"] / n["predicted"]["step_time_s"]}
    row["peak_equal"] = o["measured"]["peak_bytes"] == o["predicted"]["peak_bytes"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating (the fastest kept)")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads per rank")
    parser.add_argument("--bucket-mb", type=float,
                        help="gradient bucket size in MiB (default: per model, small enough for several buckets)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        for name in args.models.split(","):
            for workers in (int(w) for w in args.workers.split(",")):
                bucket = int(args.bucket_mb * 1024 * 1024) if args.bucket_mb else BUCKET_BYTES[name]
                rows.append(bench(name, workers, args.steps, args.threads, bucket, args.repeats, Path(tmp)))
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                      "global_batch": BATCH, "steps": args.steps, "repeats": args.repeats, "threads": args.threads,
                      "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
