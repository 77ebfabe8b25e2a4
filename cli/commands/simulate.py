"""`memsched simulate`: the predicted step of a model's default schedule."""
from __future__ import annotations

from memsched.cli.options import (add_dim_option, add_hardware_option, add_json_option, add_training_options,
                                   check_training_options)
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("simulate", help="predicted step time of a model's default schedule")
    p.add_argument("model", help="an .onnx file")
    add_hardware_option(p, what="the profile to simulate on")
    p.add_argument("--costs", help="a cost table from `memsched profile` (else the roofline)")
    add_dim_option(p)
    add_training_options(p)
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.pipeline import load_graph

    from memsched import frontend
    from memsched.cost import CostTable
    from memsched.schedule import Plan
    from memsched.simulate import simulate
    from memsched.views import print_simulation

    check_training_options(args)
    graph = load_graph(args.model, frontend.parse_dims(args.dim), args.train, args.loss, args.optimizer, args.lr,
                       tuple(args.freeze))
    costs = CostTable.load(args.costs) if args.costs else None
    result = simulate(Plan.initial(graph), args.hardware, costs).to_dict()
    if args.json:
        print_json(result)
    else:
        print_simulation(result)
    return 0
