"""Conv weight gradient, two formulations on ONNX Runtime: transposes vs grouped by sample.

passes.training computes a conv's dW either as Conv(X^T, dY^T) -- X and dY transposed to
[C, N, ...], the result transposed back -- or, where batch x weight is the smaller, as one
Conv of one more axis grouped by sample over views of X and dY ([1, N, C, H, W] and
[N*Co, 1, 1, h, w]), summed over the batch. This times both at ResNet layer sizes (one
intra-op thread, graph optimisations off, as the executor runs ops; best of 5 runs after a
warm-up), checks they agree, and prints one JSON object: per case the milliseconds of each
and their ratio, and the bytes of activation-sized transposes the first needs.

    python bench/bench_conv_dw.py
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched.onnx_utils import make_model  # noqa: E402

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
CASES = [(2, 64, 64, 56), (8, 64, 64, 56), (2, 32, 32, 32), (8, 256, 256, 14)]   # N, C, Co, H (3x3, pad 1)


def _session(nodes, n, c, co, h, initializers=()):
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", FLOAT, [n, c, h, h]),
                                            helper.make_tensor_value_info("dy", FLOAT, [n, co, h, h])],
                              [helper.make_tensor_value_info("dw", FLOAT, None)], list(initializers))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(make_model(graph).SerializeToString(), options, providers=["CPUExecutionProvider"])


def transposed(n, c, co, h):
    return _session([helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
                     helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
                     helper.make_node("Conv", ["xt", "dyt"], ["o"], kernel_shape=[h, h], pads=[1, 1, 1, 1]),
                     helper.make_node("Transpose", ["o"], ["dw"], perm=[1, 0, 2, 3])], n, c, co, h)


def by_sample(n, c, co, h):
    shapes = [helper.make_tensor("s1", INT64, [5], [1, n, c, h, h]),
              helper.make_tensor("s2", INT64, [5], [n * co, 1, 1, h, h]),
              helper.make_tensor("s3", INT64, [5], [n, co, c, 3, 3]), helper.make_tensor("axis", INT64, [1], [0])]
    return _session([helper.make_node("Reshape", ["x", "s1"], ["a"]), helper.make_node("Reshape", ["dy", "s2"], ["k"]),
                     helper.make_node("Conv", ["a", "k"], ["o"], group=n, kernel_shape=[1, h, h],
                                      pads=[0, 1, 1, 0, 1, 1]),
                     helper.make_node("Reshape", ["o", "s3"], ["per_sample"]),
                     helper.make_node("ReduceSum", ["per_sample", "axis"], ["dw"], keepdims=0)],
                    n, c, co, h, shapes)


def best_of(session, feeds, runs: int = 5) -> float:
    session.run(None, feeds)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> int:
    rng = np.random.default_rng(0)
    rows = []
    for n, c, co, h in CASES:
        feeds = {"x": rng.random((n, c, h, h), dtype=np.float32), "dy": rng.random((n, co, h, h), dtype=np.float32)}
        old, new = transposed(n, c, co, h), by_sample(n, c, co, h)
        a, b = old.run(None, feeds)[0], new.run(None, feeds)[0]
        agree = bool(np.allclose(a, b, rtol=1e-4, atol=1e-3 * float(np.abs(a).max())))
        t_old, t_new = best_of(old, feeds), best_of(new, feeds)
        rows.append({"batch": n, "channels": c, "out_channels": co, "size": h, "agree": agree,
                     "transposes_ms": round(t_old * 1e3, 3), "by_sample_ms": round(t_new * 1e3, 3),
                     "ratio": round(t_new / t_old, 3), "transposed_bytes": 4 * n * (c + co) * h * h})
        print(f"N={n} C={c} Co={co} H={h}: {rows[-1]['ratio']} x", file=sys.stderr)
    ratios = [r["ratio"] for r in rows]
    print(json.dumps({"cases": rows, "mean_ratio": round(sum(ratios) / len(ratios), 3),
                      "all_agree": all(r["agree"] for r in rows), "provider": "CPUExecutionProvider"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
