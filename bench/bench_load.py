"""How long loading a model with its weights takes, and how much memory: `frontend.load` (parse,
shape inference, checks, lowering) of a bundled model exported with its weights, in a fresh
process, wall seconds and the process's peak RSS (VmHWM: ru_maxrss would count the parent's
peak from before the exec), next to the file's size and the
peak of `onnx.load` alone (what parsing the file costs any tool). Prints one JSON object.

    python bench/bench_load.py [--cases gpt2-60-layers,resnet50-b16] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_report import emit  # noqa: E402

# name -> (bundled model, build options)
CASES = {"gpt2-60-layers": ("gpt2", {"batch": 4, "seq": 128, "layers": 60}),
         "bert-base-b8": ("bert-base", {"batch": 8, "seq": 128}),
         "resnet50-b16": ("resnet50", {"batch": 16})}

WORKER = """
import json, sys, time
sys.path.insert(0, {root!r})
what, path = sys.argv[1], sys.argv[2]
started = time.perf_counter()
if what == "parse":
    import onnx
    onnx.load(path, load_external_data=False)
else:
    from memsched import frontend
    frontend.load(path)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"seconds": round(time.perf_counter() - started, 2), "peak_rss_bytes": peak}}))
"""


def measure(what: str, path: Path) -> dict:
    code = WORKER.format(root=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", code, what, str(path)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES))
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    from memsched import models

    rows = []
    with tempfile.TemporaryDirectory(prefix="memsched-bench-load-") as scratch:
        for name in [n.strip() for n in args.cases.split(",") if n.strip()]:
            model, options = CASES[name]
            path = models.export(model, Path(scratch) / f"{name}.onnx", **options)
            rows.append({"case": name, "file_bytes": path.stat().st_size,
                         "onnx_load": measure("parse", path), "memsched_load": measure("load", path)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            path.unlink()
    return emit({"bench": "load", "runs": rows}, args.out)


if __name__ == "__main__":
    sys.exit(main())
