"""Training with memsched against PyTorch and against a plain ONNX Runtime loop, on digits.

Two models, each compiled at --budget 60% (momentum SGD, lr 0.05): the bundled MLP (8x8
digits) and a conv-BN-ReLU network exported by `memsched.torch.export_for_training`. Each is
trained by memsched's Trainer and by torch.optim from the same initial weights on the same
batches (one thread each side, --epochs epochs), and reported:

- the largest per-step loss difference over the first 100 steps and over the whole run, against
  PyTorch in float32 and in float64 (the same module in double precision on the same batches:
  the exact maths; PyTorch's own float32 run drifts from it on some CPUs);
- the test accuracy of the saved inference model in a plain onnxruntime.InferenceSession,
  and PyTorch's in eval mode;
- BatchNorm running statistics against PyTorch's after 50 steps, float32 and float64 (the CNN);
- speed: the Trainer's median step time over --steps steps against a plain ONNX Runtime
  training loop of the same step graph with IOBinding (every static bound as an input, each
  `<name>.updated` output bound as the next step's `<name>`), same threads; interleaved in
  rounds, ratios from this one run; and how many ONNX Runtime sessions the Trainer built
  after its first step (none).

Prints one JSON object.

    python bench/bench_train.py [--epochs 20] [--steps 500] [--threads 1] [--time-limit 20]
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import onnx  # noqa: E402
import torch  # noqa: E402

from memsched.data import batches  # noqa: E402
from memsched.runtime import reference_model  # noqa: E402
from memsched.inference import export_inference  # noqa: E402
from memsched.ort import reference_session  # noqa: E402
from memsched.torch import export_for_training  # noqa: E402
from memsched.runtime import Trainer  # noqa: E402
from memsched.passes.pipeline import compile as compile_plan  # noqa: E402
from tests import digits  # noqa: E402

BATCH, LR = 64, 0.05


def plain_loop(graph, steps: list[dict], threads: int) -> list[float]:
    """Seconds per step of a plain ONNX Runtime training loop with IOBinding over `steps`."""
    session = reference_session(reference_model(graph).SerializeToString(), threads, "cpu")
    statics = {t.name: np.array(_value(t, graph)) for t in graph.initializers()}
    outputs = {name: np.empty(graph.tensors[name].shape, _dtype(graph, name)) for name in graph.outputs}
    binding = session.io_binding()
    times = []
    for batch in steps:
        start = time.perf_counter()
        for name, value in {**batch, **statics}.items():
            binding.bind_cpu_input(name, value)
        for name, value in outputs.items():
            binding.bind_output(name, "cpu", 0, value.dtype, value.shape, value.ctypes.data)
        session.run_with_iobinding(binding)
        for name in statics:          # each update is the next step's value: swap the two arrays
            updated = f"{name}.updated"
            if updated in outputs:
                statics[name], outputs[updated] = outputs[updated], statics[name]
        times.append(time.perf_counter() - start)
    return times


def _value(t, graph):
    from memsched.ir import tensor_value

    return tensor_value(t, graph.base_dir)


def _dtype(graph, name):
    return onnx.helper.tensor_dtype_to_np_dtype(graph.tensors[name].dtype)


def speed(plan, train: dict, steps: int, threads: int, rounds: int = 5) -> dict:
    """The Trainer's and the plain loop's median step time, interleaved in `rounds`."""
    batch_list = [b for e in range(steps // (len(train["labels"]) // BATCH) + 1)
                  for b in batches(train, BATCH, e, shuffle=True, seed=2)][:steps]
    per_round = max(1, steps // rounds)
    ours, theirs = [], []
    with Trainer(plan, threads=threads) as trainer:
        trainer.step(batch_list[0])
        sessions = len(trainer._runner.rt.sessions)
        for k in range(rounds):
            part = batch_list[k * per_round:(k + 1) * per_round]
            ours += [trainer.step(b).seconds for b in part]
            theirs += plain_loop(plan.graph, part, threads)
        built_after_first = len(trainer._runner.rt.sessions) - sessions
    return {"steps": len(ours), "threads": threads, "trainer_step_s": statistics.median(ours),
            "plain_ort_iobinding_step_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs),
            "sessions": sessions, "sessions_built_after_first_step": built_after_first}


def compare(name: str, path: Path, module, dims, train, test, epochs: int, threads: int, time_limit: float,
            steps: int, folder: Path) -> dict:
    result = compile_plan(str(path), dims=dims, train=True, optimizer="momentum", lr=LR, budget="60%",
                          time_limit=time_limit)
    plan, report = result.plan, result.report
    schedule = [b for e in range(epochs) for b in batches(train, BATCH, e, shuffle=True, seed=1)]
    exact = copy.deepcopy(module).double()
    run, run64 = digits.TorchRun(module, "momentum", LR), digits.TorchRun(exact, "momentum", LR)
    schedule64 = [{**b, "input": b["input"].astype(np.float64)} for b in schedule]
    with Trainer(plan, threads=threads) as trainer:
        ours = [trainer.step(b).loss for b in schedule[:50]]
        theirs, theirs64 = run.losses(schedule[:50]), run64.losses(schedule64[:50])
        state, reference, reference64 = trainer.state_dict(), module.state_dict(), exact.state_dict()
        running = {k: float(np.abs(state[k] - reference[k].numpy()).max()) for k in state if "running" in k}
        running64 = {k: float(np.abs(state[k] - reference64[k].numpy()).max()) for k in state if "running" in k}
        ours += [trainer.step(b).loss for b in schedule[50:]]
        theirs += run.losses(schedule[50:])
        theirs64 += run64.losses(schedule64[50:])
        saved = export_inference(trainer.graph, trainer.state_dict(), folder / f"{name}.onnx")
    diff, diff64 = np.abs(np.subtract(ours, theirs)), np.abs(np.subtract(ours, theirs64))
    accuracy, torch_accuracy = digits.onnx_accuracy(saved, test), digits.torch_accuracy(module, test)
    return {
        "model": name, "budget_bytes": report["budget_bytes"], "baseline_peak_bytes": report["baseline"]["peak_bytes"],
        "plan_peak_bytes": report["plan"]["peak_bytes"], "plan_arena_bytes": report["plan"]["arena_bytes"],
        "strategies_used": sorted(k for k in ("recompute", "swap") if k in plan.notes),
        "steps": len(ours), "max_loss_diff_first_100": float(diff[:100].max()),
        "max_loss_diff_all": float(diff.max()), "final_loss": ours[-1], "torch_final_loss": theirs[-1],
        "max_loss_diff_first_100_float64": float(diff64[:100].max()), "max_loss_diff_all_float64": float(diff64.max()),
        "test_accuracy_plain_ort": accuracy, "torch_test_accuracy": torch_accuracy,
        "accuracy_diff": abs(accuracy - torch_accuracy),
        "running_statistics_max_diff_after_50_steps": running or None,
        "running_statistics_max_diff_after_50_steps_float64": running64 or None,
        "speed": speed(plan, train, steps, threads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train, test = digits.split()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        from memsched.models.mlp import mlp

        model = mlp(batch=BATCH, size=8)
        onnx.save(model, folder / "mlp.onnx")
        rows.append(compare("mlp", folder / "mlp.onnx", digits.mlp_module(model).module, None, train, test,
                            args.epochs, args.threads, args.time_limit, args.steps, folder))
        module = digits.conv_bn_net()
        export_for_training(module, torch.zeros(BATCH, 1, 8, 8), folder / "cnn.onnx", input_names=["input"],
                            output_names=["logits"])
        rows.append(compare("conv-bn-relu", folder / "cnn.onnx", module, {"batch": BATCH}, train, test,
                            args.epochs, args.threads, args.time_limit, args.steps, folder))
    print(json.dumps({"machine": platform.machine(), "processor": platform.processor(), "epochs": args.epochs,
                      "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
