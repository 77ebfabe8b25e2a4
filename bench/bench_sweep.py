"""memsched's smallest planned peak at zero, <= 5 % and <= 10 % predicted overhead, on MAGIS's
workloads, against PyTorch eager's peak for the same SGD step.

    python bench/bench_sweep.py [--only resnet50-b64 ...] [--fractions 0.6 0.35 0.25 0.15]
        [--time-limit 60] [--out FILE]

Workloads (MAGIS, ASPLOS 2024): ResNet-50 b64 224, ViT-B/16 b64 224 (torchvision's, exported
by torch), BERT-base b32 x 512, U-Net b32 256, a GPT-Neo-1.3B-shaped decoder b32 x 512
(bundled `gpt2` with 24 layers of 2,048, planned only; weights left out, only sizes matter).
With `--only`, also the zero-overhead rows of bench_vs_torch.py: ResNet-18 b32, ResNet-50 b16
and BERT-base 8 x 128.

PyTorch eager's peak is computed, not run: the step (forward, cross-entropy, backward,
torch.optim.SGD) runs on the meta device under a dispatch mode that adds each new storage's
bytes and takes them off when the storage is freed (parameters and buffers count from the
start). That is the peak of the tensors PyTorch holds, without the CUDA caching allocator's
rounding; for ResNet-50 b64 it equals torch's own MemTracker under FakeTensorMode to the byte.
The PyTorch modules: torchvision's ResNet-50 and ViT-B/16, the BERT module of
bench_vs_torch.py, milesial's U-Net and Hugging Face's GPT-2 with eager attention at
GPT-Neo-1.3B's shape (bench/torch_models.py, each the model memsched plans, parameter for
parameter). Each row also gives memsched's eager-equivalent baseline (the step in its own
order, every gradient alive until its update, updates in place).

memsched: the zero-overhead plan (order, reuse; no budget), then one `compile` with every
strategy at each budget fraction of the reference, on `h100-80gb`, each with its own
`--time-limit`; the smallest peak whose predicted overhead is <= 0 %, 5 % and 10 %.

torch.compile's `activation_memory_budget` column is not measured here: inductor on this
machine's CPU cannot run these steps (ResNet-50 b64's eager step alone holds 5.6 GB, BERT
b32 x 512's and the decoder's far more), and AOTAutograd's partition run op by op without
inductor's fusion holds more than eager (ResNet-50 b64: 6.42 GB against 5.62 GB), so it is
not the figure torch.compile gives. One JSON document on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memsched import models  # noqa: E402
from memsched.errors import BudgetError  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402

PROFILE = "h100-80gb"
GPT_NEO_1_3B = {"layers": 24, "hidden": 2048, "heads": 16, "max_positions": 2048}
WORKLOADS = {
    "resnet50-b64": {"memsched": ("resnet50", {"batch": 64, "size": 224}), "torch": "resnet50", "batch": 64},
    "vit-b16-b64": {"onnx": "vit_b_16", "torch": "vit_b_16", "batch": 64},
    "bert-base-b32x512": {"memsched": ("bert-base", {"batch": 32, "seq": 512}), "torch": "bert", "batch": 32,
                          "seq": 512},
    "unet2d-b32": {"memsched": ("unet2d", {"batch": 32, "size": 256}), "torch": "unet2d", "batch": 32, "size": 256},
    "gpt-1.3b-b32x512": {"memsched": ("gpt2", {"batch": 32, "seq": 512, **GPT_NEO_1_3B}), "torch": "gpt2", "batch": 32,
                         "seq": 512},
    # the zero-overhead rows of bench_vs_torch.py, planned with every strategy too
    "resnet18-b32": {"memsched": ("resnet18", {"batch": 32, "size": 224}), "torch": "resnet18", "batch": 32},
    "resnet50-b16": {"memsched": ("resnet50", {"batch": 16, "size": 224}), "torch": "resnet50", "batch": 16},
    "bert-base-b8x128": {"memsched": ("bert-base", {"batch": 8, "seq": 128}), "torch": "bert", "batch": 8,
                         "seq": 128},
}
MAGIS = ("resnet50-b64", "vit-b16-b64", "bert-base-b32x512", "unet2d-b32", "gpt-1.3b-b32x512")


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- PyTorch eager, on the meta device ---------------------------------------------------------
def torch_eager_peak(workload: str) -> dict:
    """Peak bytes of one SGD step of the workload's PyTorch module, computed on the meta device."""
    import torch

    name, batch = WORKLOADS[workload]["torch"], WORKLOADS[workload]["batch"]

    def module():
        if name == "bert":
            from bench.bench_vs_torch import bert_module
            return bert_module()
        if name == "unet2d":
            from bench.torch_models import milesial_unet
            return milesial_unet()
        if name == "gpt2":
            from bench.torch_models import hf_gpt2
            return hf_gpt2(**{key: GPT_NEO_1_3B[key] for key in ("layers", "hidden", "heads")},
                           positions=GPT_NEO_1_3B["max_positions"])
        import torchvision
        return getattr(torchvision.models, name)()

    def batch_of():
        if name in ("bert", "gpt2"):  # a class per sequence / a token per position
            seq = WORKLOADS[workload]["seq"]
            labels = batch if name == "bert" else batch * seq
            return torch.zeros(batch, seq, dtype=torch.int64), torch.zeros(labels, dtype=torch.int64)
        if name == "unet2d":  # per-pixel labels
            size = WORKLOADS[workload]["size"]
            return torch.zeros(batch, 3, size, size), torch.zeros(batch, size, size, dtype=torch.int64)
        return torch.zeros(batch, 3, 224, 224), torch.zeros(batch, dtype=torch.int64)

    started = time.perf_counter()
    peak = meta_step_peak(module, batch_of)
    return {"torch_eager_peak_bytes": peak, "torch_eager_seconds": round(time.perf_counter() - started, 2),
            "reference": "PyTorch eager (computed on the meta device)"}


def meta_step_peak(make_module, make_batch) -> int:
    """Peak bytes PyTorch eager holds in one SGD step (forward, cross-entropy, backward,
    torch.optim.SGD) of the module `make_module()` on the batch `make_batch()` (inputs,
    labels), both made on the meta device, so no step runs: a dispatch mode adds each new
    storage's bytes and takes them off when the storage is freed; parameters and buffers
    count from the start."""
    import torch
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Storages(TorchDispatchMode):
        """Live bytes of the storages created under it (each counted once, off when freed)."""

        def __init__(self):
            super().__init__()
            self.live = self.peak = 0
            self.refs: dict[int, weakref.ref] = {}

        def track(self, tensor) -> None:
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self.refs:
                return
            size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)

            def freed(_, key=key, size=size):
                self.live -= size
                self.refs.pop(key, None)
            self.refs[key] = weakref.ref(storage, freed)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in pytree.tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self.track(leaf)
            return out

    with torch.device("meta"):
        module = make_module()
        inputs, labels = make_batch()
    module.train()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    storages = Storages()
    for tensor in list(module.parameters()) + list(module.buffers()):
        storages.track(tensor)
    with storages:
        loss = torch.nn.functional.cross_entropy(module(inputs), labels)
        loss.backward()
        optimizer.step()
    return storages.peak


def exported_vit(batch: int):
    """torchvision's ViT-B/16 as torch.onnx.export writes it (TorchScript exporter, opset 17),
    traced at `batch` (exported with a named batch dimension, its Reshapes' shapes are left
    to a probe run past the front end's 1 GiB limit), its shape arithmetic folded by ONNX
    Runtime's basic optimizations. Traced with gradients on, as for
    training: without them nn.MultiheadAttention takes its fused inference kernel, which the
    exporter cannot write."""
    import onnx
    import torch
    import torchvision

    import onnxruntime as ort

    module = torchvision.models.vit_b_16()
    with tempfile.TemporaryDirectory() as scratch:
        exported, folded = os.path.join(scratch, "vit.onnx"), os.path.join(scratch, "vit-folded.onnx")
        torch.onnx.export(module, torch.zeros(batch, 3, 224, 224), exported, opset_version=17, dynamo=False,
                          input_names=["images"], output_names=["logits"])
        # the class token's Expand takes its shape from Shape ops that ONNX's inference does not
        # propagate: ONNX Runtime's basic level folds them (standard ops only), as onnxsim would
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = folded
        ort.InferenceSession(exported, options, providers=["CPUExecutionProvider"])
        return lower(onnx.load(folded))


# ---- memsched ---------------------------------------------------------------------------------
def forward_graph(workload: str):
    spec = WORKLOADS[workload]
    if "onnx" in spec:
        return exported_vit(spec["batch"])
    name, options = spec["memsched"]
    return lower(models.build(name, weights=False, **options))


def plan_point(graph, budget: int | None, time_limit: float) -> dict:
    started = time.perf_counter()
    try:
        result = compile_plan(graph, train=True, hardware=PROFILE, budget=budget, time_limit=time_limit,
                              strategies=None if budget is not None else ("order", "reuse"))
    except BudgetError as err:
        return {"budget_bytes": budget, "fits": False, "smallest_bytes": err.smallest_feasible_bytes,
                "compile_s": round(time.perf_counter() - started, 1)}
    report = result.report
    return {"budget_bytes": budget, "fits": True, "peak_bytes": report["plan"]["peak_bytes"],
            "arena_bytes": report["plan"]["arena_bytes"], "overhead": round(report["plan"]["overhead"], 4),
            "baseline_peak_bytes": report["baseline"]["peak_bytes"], "ops": report["graph"]["ops"],
            "deadline_hit": report["solver"]["deadline_hit"], "micro_batches": report["plan"]["micro_batches"],
            "compile_s": round(time.perf_counter() - started, 1)}


def smallest(points: list[dict], overhead: float) -> int | None:
    """The smallest arena among the plans within `overhead`."""
    fitting = [p["arena_bytes"] for p in points if p["fits"] and p["overhead"] <= overhead + 1e-9]
    return min(fitting, default=None)


def sweep(workload: str, fractions: list[float], time_limit: float) -> dict:
    say(f"{workload}: building the step")
    graph = forward_graph(workload)
    zero = plan_point(graph, None, time_limit)
    row = {"workload": workload, "ops": zero.get("ops"), "memsched_baseline_bytes": zero.get("baseline_peak_bytes")}
    if WORKLOADS[workload]["torch"]:
        row.update(torch_eager_peak(workload))
        reference = row["torch_eager_peak_bytes"]
    else:
        reference = zero["baseline_peak_bytes"]
        row["reference"] = "memsched's eager-equivalent baseline (no PyTorch module of this workload here)"
    row["reference_bytes"] = reference
    say(f"{workload}: zero-overhead plan {zero.get('arena_bytes')} B against {reference} B")
    points = [dict(zero, fraction=None)]
    for fraction in fractions:
        point = dict(plan_point(graph, int(fraction * reference), time_limit), fraction=fraction)
        say(f"{workload} at {fraction:.2f}: {json.dumps(point)}")
        points.append(point)
    row["points"] = points
    for name, overhead in (("zero", 0.0), ("5pct", 0.05), ("10pct", 0.10)):
        best = smallest(points, overhead)
        row[f"smallest_at_{name}_bytes"] = best
        row[f"ratio_at_{name}"] = None if best is None else round(best / reference, 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(WORKLOADS), metavar="NAME")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.35, 0.25, 0.15])
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    rows = []
    for workload in args.only or MAGIS:
        try:
            rows.append(sweep(workload, args.fractions, args.time_limit))
        except Exception as exc:  # noqa: BLE001 - a workload this machine cannot plan is a row that says why
            rows.append({"workload": workload, "error": f"{type(exc).__name__}: {exc}"})
        say(json.dumps({k: v for k, v in rows[-1].items() if k != "points"}))
    document = {"benchmark": "budget-sweep", "hardware": PROFILE, "time_limit_s": args.time_limit,
                "fractions": args.fractions, "cpu_count": os.cpu_count(), "rows": rows}
    text = json.dumps(document, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
