"""Zero-overhead memory savings on training graphs: reuse -> order -> placement vs the baseline.

For every bundled network (models/) at two small batch sizes, and for two torch-exported
networks (bench/torch_models.py, when torch is installed), the SGD training step from
passes.training is planned as `memsched compile --strategies order,reuse` plans it:
reuse (updates in the backward, SGD updates fused into their dW Gemms, dW/dX rule,
in-place), order (CP-SAT, warm-started), placement (arena offsets). The baseline is the
graph in autodiff's order, updates at the end, nothing in place: `Plan.initial(graph)`
(views copy); a second baseline shares each view's storage with its input, as frameworks
run views (`ratio_views_shared`). A synthetic ~5,000-op training chain checks that the
largest graphs finish inside the time limit.

Prints one JSON object: per graph the baseline and plan peaks, their ratio, the arena and
arena/peak, the order pass's proven lower bound (and its ratio to the baseline: no order
with in-place can do better), its status, and seconds per pass; then a summary (mean and
max ratio, mean lower-bound ratio, max arena/peak, whether every pass kept to its limit).

    python bench/bench_order_reuse.py --time-limit 60
    python bench/bench_order_reuse.py --models mlp,resnet18 --batches 1,2 --time-limit 10
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memsched import models  # noqa: E402
from memsched.frontend import lower  # noqa: E402
from memsched.memory import analyze, analyze_plan, validate  # noqa: E402
from memsched.ops import VIEW_OPS  # noqa: E402
from memsched.schedule import Plan  # noqa: E402
from memsched.passes.order import order_pass  # noqa: E402
from memsched.passes.placement import place_pass  # noqa: E402
from memsched.passes.pipeline import training_steps  # noqa: E402
from memsched.passes.reuse import choose_aliases, reuse_pass  # noqa: E402


def training_graph(name: str, batch: int, model=None):
    """The SGD training step of bundled model `name` at `batch` (other options: defaults),
    or of the ONNX `model` given, and the rewritten steps reuse may pick instead. Cross-entropy,
    but binary on logits for the DCGAN discriminator (one logit per image)."""
    model = model if model is not None else models.build(name, batch=batch)
    loss = "bce_with_logits" if name == "dcgan-discriminator" else "cross_entropy"
    return training_steps(lower(model), loss=loss, optimizer="sgd")


def synthetic_graph(layers: int = 700):
    """A training chain of `layers` weighted layers (7 ops each) from the test graphs."""
    from tests.graphs import training_chain

    sizes = [((i % 3 + 1) * 2**20, (i % 5 + 1) * 2**18) for i in range(layers)]
    return training_chain(sizes, 2**20, name=f"synthetic-chain-{layers}")


def plan_graph(graph, time_limit: float, place_limit: float, variants=None) -> dict:
    """Baseline and plan figures for one training graph (every figure from the memory model);
    `variants`: the rewritten steps reuse may pick (`memsched compile` has them)."""
    baseline = Plan.initial(graph)
    base_peak = analyze_plan(baseline).peak_bytes
    # the baseline as a framework with views runs it (a reshape shares its input's storage,
    # nothing is written in place): a second yardstick, stricter where views were copies
    views = {out: src for out, src in choose_aliases(graph, baseline.schedule).items()
             if graph.producer[out].op_type in VIEW_OPS}
    base_views_peak = analyze(graph, baseline.schedule, views).peak_bytes
    seconds = {}
    started = time.perf_counter()
    plan = reuse_pass(baseline, variants=variants)
    seconds["reuse"] = time.perf_counter() - started
    started = time.perf_counter()
    plan = order_pass(plan, time_limit=time_limit)
    seconds["order"] = time.perf_counter() - started
    started = time.perf_counter()
    plan = place_pass(plan, time_limit=place_limit)
    seconds["placement"] = time.perf_counter() - started
    profile = validate(plan)
    order, placement, reuse = plan.notes["order"], plan.notes["placement"], plan.notes["reuse"]
    peak = profile.peak_bytes
    return {
        "ops": len(graph.ops),
        "baseline_peak_bytes": base_peak,
        "reuse_peak_bytes": reuse["peak_bytes"],
        "plan_peak_bytes": peak,
        "ratio": round(peak / base_peak, 4),
        "baseline_views_shared_peak_bytes": base_views_peak,
        "ratio_views_shared": round(peak / base_views_peak, 4),
        "arena_bytes": placement["arena_bytes"],
        "arena_over_peak": round(placement["arena_bytes"] / peak, 4),
        "lower_bound_bytes": order["lower_bound_bytes"],
        "lower_bound": order["lower_bound"],
        "lower_bound_ratio": round(order["lower_bound_bytes"] / base_peak, 4),
        "order_status": order["status"],
        "order_start": order["start"],
        "order_cpsat": order["cpsat"],
        "deterministic": order["deterministic"],
        "placement_status": placement["status"],
        "placement_method": placement["method"],
        "reuse": {k: reuse[k] for k in ("order", "variant", "fused_updates", "aliases", "updates_in_place",
                                        "updates_in_backward", "layers_dw_first", "layers_dx_first")},
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "within_limit": seconds["order"] <= time_limit * 1.05 and seconds["placement"] <= place_limit * 1.05,
    }


def torch_cases(batches: list[int]) -> list[tuple]:
    """(name, batch, model) for the torch-exported networks; none where torch is missing."""
    try:
        from bench.torch_models import exported
    except ImportError:
        return []
    try:
        return [(name, batch, model) for batch in batches for name, model in exported(batch).items()]
    except ImportError:
        print("bench_order_reuse: torch is not installed; the torch-exported networks are skipped",
              file=sys.stderr)
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models.NAMES), help="comma-separated model names")
    parser.add_argument("--batches", default="1,2", help="comma-separated batch sizes")
    parser.add_argument("--time-limit", type=float, default=60.0, help="order pass seconds per graph")
    parser.add_argument("--place-limit", type=float, default=10.0, help="placement seconds per graph")
    parser.add_argument("--synthetic-layers", type=int, default=700,
                        help="layers of the synthetic chain (7 ops each); 0 to skip")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch-exported networks")
    args = parser.parse_args(argv)
    rows = []
    batches = [int(b) for b in args.batches.split(",")]
    cases = [(name, batch, None) for name in args.models.split(",") if name.strip() for batch in batches]
    if not args.no_torch:
        cases += torch_cases(batches)
    for name, batch, model in cases:
        graph, variants = training_graph(name.strip(), batch, model)
        row = {"graph": name.strip(), "batch": batch,
               **plan_graph(graph, args.time_limit, args.place_limit, variants)}
        rows.append(row)
        print(f"{row['graph']} b={batch}: {row['ratio']:.3f} x baseline (bound {row['lower_bound_ratio']:.3f}), "
              f"arena {row['arena_over_peak']:.4f} x peak, {row['seconds']}", file=sys.stderr)
    synthetic = None
    if args.synthetic_layers:
        graph = synthetic_graph(args.synthetic_layers)
        synthetic = {"graph": graph.name, **plan_graph(graph, args.time_limit, args.place_limit)}
    ratios = [r["ratio"] for r in rows]
    summary = {
        "graphs": len(rows),
        "mean_ratio": round(sum(ratios) / len(ratios), 4) if ratios else None,
        "max_ratio": max(ratios, default=None),
        "mean_ratio_views_shared": round(sum(r["ratio_views_shared"] for r in rows) / len(rows), 4) if rows else None,
        "mean_lower_bound_ratio": round(sum(r["lower_bound_ratio"] for r in rows) / len(rows), 4) if rows else None,
        "max_arena_over_peak": max((r["arena_over_peak"] for r in rows), default=None),
        "all_within_limit": all(r["within_limit"] for r in rows + ([synthetic] if synthetic else [])),
        "time_limit_s": args.time_limit,
        "place_limit_s": args.place_limit,
    }
    print(json.dumps({"graphs": rows, "synthetic": synthetic, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
