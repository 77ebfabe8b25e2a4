"""`memsched inspect`: a model's ops, tensors, parameters and default-order peak."""
from __future__ import annotations

from memsched.cli.options import add_dim_option, add_json_option
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("inspect", help="ops, tensors, parameters and the default-order peak of a model")
    p.add_argument("model", help="an .onnx file")
    add_dim_option(p)
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched import frontend
    from memsched.summary import inspect_graph
    from memsched.views import print_inspect

    graph = frontend.load(args.model, frontend.parse_dims(args.dim))
    summary = inspect_graph(graph)
    if args.json:
        print_json(summary)
    else:
        print_inspect(summary)
    return 0
