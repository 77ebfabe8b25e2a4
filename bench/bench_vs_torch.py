"""PyTorch's own peak for one SGD step against memsched's baseline and order+reuse plan.

    PYTHONPATH=<dir with torch> python bench/bench_vs_torch.py [--models resnet18,bert-base]
        [--time-limit 60]

Models and batches (the issue's table): resnet18 b32 224, resnet50 b16 224, mobilenetv2 b32
224, bert-base 8 x 128. PyTorch side: torchvision's classifiers and BertForSequenceClassification
written out in torch (torchvision and transformers are not installed here; bench/torch_models.py
and `bert_module` below mirror models/ -- ReLU in place as torchvision has it, eager attention,
exact GELU, no dropout), one step `loss.backward(); optimizer.step()` with torch.optim.SGD on
the CPU, its peak read from torch's memory profiler (profile_memory=True: the timeline of
allocations and frees, parameters included as pre-existing). memsched side: the SGD training
step of models.build(name) (weights left out: only sizes matter), its baseline peak as
PyTorch eager runs the step (the step's own order, every gradient alive until its update,
updates in place: passes.reuse.baseline_aliases) and the peak of the plan `memsched compile
--train --strategies order,reuse` makes (no budget). torch is not a dependency of memsched: without it the
PyTorch column is left out. `--torch-device cuda` runs PyTorch's step on the GPU instead and
reads its CUDA allocator's high-water mark (parameters and cuDNN/cuBLAS workspaces included;
the second of two steps). One JSON line per model, then the whole table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memsched import models  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.memory import validate  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.passes.training import build_training_step  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402
from memsched.passes.reuse import baseline_aliases  # noqa: E402

# name -> the models.build options of the table
CASES = {"resnet18": {"batch": 32, "size": 224}, "resnet50": {"batch": 16, "size": 224},
         "mobilenetv2": {"batch": 32, "size": 224}, "bert-base": {"batch": 8, "seq": 128}}


def memsched_peaks(name: str, time_limit: float) -> dict[str, int | float]:
    """Baseline and order+reuse plan peaks of model `name`'s SGD step, exact bytes."""
    forward = lower(models.build(name, weights=False, **CASES[name]))
    step = build_training_step(forward, optimizer="sgd")
    baseline = validate(dataclasses.replace(Plan.initial(step), aliases=baseline_aliases(step))).peak_bytes
    started = time.perf_counter()
    result = compile_plan(forward, train=True, optimizer="sgd", strategies=("order", "reuse"),
                          time_limit=time_limit)
    return {"memsched_baseline": baseline, "memsched_plan": result.profile.peak_bytes,
            "compile_s": round(time.perf_counter() - started, 1)}


def torch_step_peak(module, inputs, labels) -> int:
    """Peak bytes of one SGD step of `module` on `inputs` (cross-entropy against `labels`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        loss = torch.nn.functional.cross_entropy(module(inputs), labels)
        loss.backward()
        optimizer.step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE):
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def torch_cuda_step_peak(module, inputs, labels) -> int:
    """Peak bytes of one SGD step on the GPU, from torch's CUDA allocator (its high-water mark
    of allocated bytes, parameters and cuDNN/cuBLAS workspaces included), after one warm-up
    step so that lazily made state (the gradients' storage, cuBLAS workspaces) exists as in
    the CPU figure's steady step."""
    import torch

    device = torch.device("cuda")
    module, inputs, labels = module.to(device), inputs.to(device), labels.to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = torch.nn.functional.cross_entropy(module(inputs), labels)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def torch_peak(name: str, device: str = "cpu") -> int | None:
    """PyTorch's peak for model `name` at its CASES size, or None without torch: on the CPU
    from its memory profiler, on "cuda" from its CUDA allocator."""
    try:
        import torch
    except ImportError:
        return None
    case = CASES[name]
    if name == "bert-base":
        module = bert_module()
        torch.manual_seed(0)
        inputs, classes = torch.randint(0, 30522, (case["batch"], case["seq"])), 2
    else:
        from torch_models import torchvision_classifier

        module = torchvision_classifier(name)
        inputs, classes = torch.randn(case["batch"], 3, case["size"], case["size"]), 1000
    measure = torch_cuda_step_peak if device == "cuda" else torch_step_peak
    return measure(module, inputs, torch.randint(0, classes, (case["batch"],)))


def bert_module(layers: int = 12, hidden: int = 768, heads: int = 12, vocab: int = 30522, positions: int = 512,
                classes: int = 2):
    """BertForSequenceClassification's layers in torch, as models/transformer.py mirrors them."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-12), nn.LayerNorm(hidden, eps=1e-12)
            self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            n, length, _ = x.shape

            def split(t):
                return t.view(n, length, heads, hidden // heads).transpose(1, 2)

            scores = split(self.q(x)) @ split(self.k(x)).transpose(-1, -2) / math.sqrt(hidden // heads)
            context = (scores.softmax(-1) @ split(self.v(x))).transpose(1, 2).reshape(n, length, hidden)
            x = self.ln1(self.o(context) + x)
            return self.ln2(self.down(nn.functional.gelu(self.up(x))) + x)

    class Bert(nn.Module):
        def __init__(self):
            super().__init__()
            self.words, self.types = nn.Embedding(vocab, hidden), nn.Embedding(2, hidden)
            self.positions, self.ln = nn.Embedding(positions, hidden), nn.LayerNorm(hidden, eps=1e-12)
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.pool, self.classifier = nn.Linear(hidden, hidden), nn.Linear(hidden, classes)

        def forward(self, ids):
            where = torch.arange(ids.shape[1], device=ids.device)[None]
            x = self.ln(self.words(ids) + self.types(torch.zeros_like(ids)) + self.positions(where))
            for layer in self.layers:
                x = layer(x)
            return self.classifier(torch.tanh(self.pool(x[:, 0])))

    return Bert()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CASES), help="comma-separated, from " + ", ".join(CASES))
    parser.add_argument("--time-limit", type=float, default=60.0, help="the compile's time limit (seconds)")
    parser.add_argument("--no-plan", action="store_true", help="baselines only (no compile)")
    parser.add_argument("--torch-device", choices=("cpu", "cuda"), default="cpu",
                        help="where PyTorch's step runs (cuda: its CUDA allocator's peak)")
    args = parser.parse_args()
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(CASES)}")
    sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench/torch_models
    table = []
    for name in names:
        row = {"model": name, **CASES[name]}
        if args.no_plan:
            step = build_training_step(lower(models.build(name, weights=False, **CASES[name])), optimizer="sgd")
            row["memsched_baseline"] = validate(dataclasses.replace(Plan.initial(step),
                                                                    aliases=baseline_aliases(step))).peak_bytes
        else:
            row.update(memsched_peaks(name, args.time_limit))
        reference = torch_peak(name, args.torch_device)
        row["torch_device"] = args.torch_device
        if reference is None:
            print("bench_vs_torch: torch is not installed; the PyTorch peak is left out", file=sys.stderr)
        else:
            row["torch"] = reference
            row.update({f"{k}_over_torch": round(row[k] / reference, 4)
                        for k in ("memsched_baseline", "memsched_plan") if k in row})
        print(json.dumps(row), flush=True)
        table.append(row)
    print(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
