"""PyTorch's own peak for one SGD step of BERT-base against memsched's training step.

    PYTHONPATH=<dir with torch> python bench/bench_vs_torch.py [--batch 8] [--seq 128]

PyTorch side: BertForSequenceClassification's layers written out in torch (transformers is not
installed here) as models/transformer.py mirrors them -- eager attention, exact (erf) GELU,
LayerNorm, no dropout -- and one step `loss.backward(); optimizer.step()` with torch.optim.SGD
on the CPU, its peak read from torch's memory profiler (profile_memory=True; the timeline of
allocations and frees, parameters included as pre-existing). memsched side: the training step
of models.build("bert-base") with SGD, baseline peak (the step's own order, no reuse) with and
without fusing GELU/LayerNorm/softmax patterns (passes.autodiff.fuse). torch is not a
dependency of memsched: without it the PyTorch column is left out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.memory import validate  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from passes.autodiff import build_training_step  # noqa: E402


def memsched_peaks(batch: int, seq: int) -> dict[str, int]:
    forward = lower(models.build("bert-base", batch=batch, seq=seq, weights=False))
    return {f"memsched_{'fused' if fuse else 'op_by_op'}":
            validate(Plan.initial(build_training_step(forward, optimizer="sgd", fuse=fuse))).peak_bytes
            for fuse in (False, True)}


def torch_peak(batch: int, seq: int, layers: int = 12, hidden: int = 768, heads: int = 12,
               vocab: int = 30522, positions: int = 512, classes: int = 2) -> int | None:
    """Peak bytes of one SGD step of a torch BERT-base on the CPU, or None without torch."""
    try:
        import torch
        from torch import nn
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action
    except ImportError:
        return None
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
            where = torch.arange(ids.shape[1])[None]
            x = self.ln(self.words(ids) + self.types(torch.zeros_like(ids)) + self.positions(where))
            for layer in self.layers:
                x = layer(x)
            return self.classifier(torch.tanh(self.pool(x[:, 0])))

    model = Bert()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ids = torch.randint(0, vocab, (batch, seq))
    labels = torch.randint(0, classes, (batch,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        loss = nn.functional.cross_entropy(model(ids), labels)
        loss.backward()
        optimizer.step()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action in (Action.PREEXISTING, Action.CREATE, Action.INCREMENT_VERSION):
            live += size if action != Action.INCREMENT_VERSION else 0
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    result = memsched_peaks(args.batch, args.seq)
    reference = torch_peak(args.batch, args.seq)
    if reference is None:
        print("bench_vs_torch: torch is not installed; the PyTorch peak is left out", file=sys.stderr)
    else:
        result["torch"] = reference
        result.update({f"{k}_over_torch": round(v / reference, 4) for k, v in list(result.items()) if k != "torch"})
    print(json.dumps({"model": "bert-base", "batch": args.batch, "seq": args.seq, **result}, indent=2))


if __name__ == "__main__":
    main()
