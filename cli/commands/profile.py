"""`memsched profile`: time every op of a model with ONNX Runtime into a cost table."""
from __future__ import annotations

from memsched.cli.options import (add_dim_option, add_json_option, add_threads_option, add_training_options,
                                   check_training_options, positive_int)
from memsched.cli.render import print_json

from memsched.outputs import check_outputs


def register(sub) -> None:
    p = sub.add_parser("profile", help="time every op of a model with ONNX Runtime -> a cost table")
    p.add_argument("model", help="an .onnx file")
    p.add_argument("-o", "--output", required=True, help="cost table to write (.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=10, help="timed runs per op (median)")
    add_threads_option(p)
    add_dim_option(p)
    add_training_options(p)
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.pipeline import load_graph

    from memsched import frontend
    from memsched.measure import profile_graph
    from memsched.views import print_cost_table

    check_outputs({"-o": args.output}, [args.model])
    check_training_options(args)
    graph = load_graph(args.model, frontend.parse_dims(args.dim), args.train, args.loss, args.optimizer, args.lr,
                       tuple(args.freeze))
    table = profile_graph(graph, device=args.device, repeats=args.repeats, threads=args.threads)
    table.save(args.output)
    slowest = sorted(graph.ops, key=lambda op: -table.times[op.name])[:10]
    summary = {**table.meta, "path": args.output, "total_s": table.total(),
               "slowest": [{"op": op.name, "op_type": op.op_type, "seconds": table.times[op.name]}
                           for op in slowest]}
    if args.json:
        print_json(summary)
    else:
        print_cost_table(summary)
    return 0
