"""`memsched check-numerics`: a float32 step's gradients against the same step in float64."""
from __future__ import annotations

from memsched.cli.options import LOSSES, add_dim_option, add_json_option, add_threads_option, positive_int
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("check-numerics", help="float32 training-step gradients against the same step in float64")
    p.add_argument("model", help="an .onnx file (a forward graph, or a training step built by train-graph)")
    add_dim_option(p)
    p.add_argument("--loss", choices=LOSSES, default="cross_entropy")
    p.add_argument("--top", type=positive_int("--top"), default=10, metavar="N", help="rows to print (default 10)")
    add_threads_option(p)
    p.add_argument("--strict", action="store_true",
                   help="let the float64 run take its own ReLU masks and max-pool choices (by default it takes "
                        "the float32 run's, so that both differentiate the same piece of the step)")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.training import build_training_step

    from memsched import frontend, numerics

    graph = frontend.load(args.model, frontend.parse_dims(args.dim))
    if not any(o.endswith((".grad", ".updated")) for o in graph.outputs):
        graph = build_training_step(graph, loss=args.loss, optimizer="none")
    rows = numerics.check(graph, threads=args.threads, pin=not args.strict)
    if args.json:
        print_json({"branches": "own" if args.strict else "float32's", "worst": rows[0].to_dict() if rows else None,
                    "rows": [r.to_dict() for r in rows[:args.top]]})
    else:
        print(numerics.format_rows(rows, args.top))
    return 0
