"""Whether each command's --time-limit holds for the whole command, measured from outside: the
wall seconds of the process (start-up, loading, every pass) against the limit it was given,
on inputs built to stress it (long chains of in-place ops, a 10,193-op GPT-2 step with
its 1.86 GB of weights written with the plan, remat graphs of 10^4 and 10^5 nodes, a
batch-size search), optionally beside busy processes. Prints one JSON object; the
acceptance is `ratio` (wall / limit) at most 1.1 for every case.

    python bench/bench_time_limits.py [--only NAME ...] [--load K] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import emit  # noqa: E402


def chain_model(path: Path, ops: int) -> Path:
    """x -> Sigmoid -> Relu -> ... (`ops` elementwise ops that run in place), 256x256 floats."""
    import onnx
    from onnx import TensorProto, helper

    nodes, previous = [], "x"
    for i in range(ops):
        nodes.append(helper.make_node("Relu" if i % 2 else "Sigmoid", [previous], [f"t{i}"], name=f"n{i}"))
        previous = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])],
                              [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [256, 256])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(path))
    return path


def remat_graph(path: Path, nodes: int) -> Path:
    """A training-shaped node-link graph: a forward chain, then a backward chain whose every
    node also reads its forward twin (Checkmate's format: cost_cpu, cost_ram)."""
    half = nodes // 2
    links = [{"source": i - 1, "target": i} for i in range(1, nodes)]
    links += [{"source": half - 1 - k, "target": half + k} for k in range(1, half)]
    data = {"directed": True, "multigraph": False, "graph": {}, "links": links,
            "nodes": [{"id": i, "cost_cpu": 1.0 + i % 7, "cost_ram": 1000 + (i % 13) * 100} for i in range(nodes)]}
    path.write_text(json.dumps(data))
    return path


def gpt2_model(path: Path) -> Path:
    """GPT-2 with 60 layers, batch 4 x 128, its 1.86 GB of weights in the file (a 10,193-op
    training step), as `memsched models export` writes it."""
    if not path.exists():
        subprocess.run([sys.executable, "-m", "memsched", "models", "export", "gpt2", "--layers", "60", "--batch", "4",
                        "--seq", "128", "-o", str(path)], check=True, capture_output=True)
    return path


def cases(scratch: Path) -> dict[str, tuple[float, callable]]:
    """name -> (time limit, () -> the command's arguments, its input built on first use)."""
    return {
        "compile-chain-5000-budget-50%": (10, lambda: ["compile", chain_model(scratch / "c5k.onnx", 5000),
                                                       "--budget", "50%", "--time-limit", "10"]),
        "compile-chain-20000": (10, lambda: ["compile", chain_model(scratch / "c20k.onnx", 20000),
                                             "--time-limit", "10", "-o", scratch / "c20k-plan.onnx"]),
        **{f"compile-gpt2-60-layers-{limit}s": (limit, lambda limit=limit: [
            "compile", gpt2_model(scratch / "gpt2-60.onnx"), "--train", "--budget", "60%", "--time-limit", str(limit),
            "-o", scratch / f"gpt2-60-plan-{limit}.onnx"]) for limit in (10, 60)},
        "remat-10k-nodes": (5, lambda: ["remat", remat_graph(scratch / "r10k.json", 10_000),
                                        "--budget-fraction", "0.5", "--time-limit", "5", "--json"]),
        "remat-100k-nodes": (30, lambda: ["remat", remat_graph(scratch / "r100k.json", 100_000),
                                          "--budget-fraction", "0.5", "--time-limit", "30", "--json"]),
        "tune-batch-resnet18-64px": (5, lambda: ["tune-batch", "resnet18", "--size", "64", "--time-limit", "5",
                                                 "--json"]),
        "tune-batch-mlp-full": (60, lambda: ["tune-batch", "mlp", "--time-limit", "60", "--json"]),
    }


def busy() -> None:
    while True:
        pass


def run_case(limit: float, argv: list) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memsched", *map(str, argv)], capture_output=True, text=True,
                          timeout=max(600, 20 * limit))
    wall = time.perf_counter() - started
    row = {"limit_s": limit, "wall_s": round(wall, 2), "ratio": round(wall / limit, 3), "exit": proc.returncode}
    if proc.returncode not in (0, 3):
        row["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
    elif "--json" in map(str, argv) and proc.returncode == 0:
        out = json.loads(proc.stdout)
        row["complete"] = out.get("complete")
        row["status"] = out.get("status")
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these cases only")
    parser.add_argument("--load", type=int, default=0, metavar="K", help="busy processes beside each run")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="memsched-bench-limits-") as scratch:
        table = cases(Path(scratch))
        names = args.only or list(table)
        unknown = sorted(set(names) - set(table))
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(table)}")
        workers = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
        rows = {}
        for name in names:
            limit, make = table[name]
            command = make()          # inputs built before the load starts and the clock runs
            for worker in workers:
                if not worker.is_alive():
                    worker.start()
            rows[name] = run_case(limit, command)
        for worker in workers:
            worker.terminate()
    return emit({"bench": "time_limits", "load": args.load, "cases": rows,
                 "worst_ratio": max((r["ratio"] for r in rows.values()), default=None)}, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
