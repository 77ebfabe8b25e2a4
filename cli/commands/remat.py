"""`memsched remat`: the least-cost recomputation plan of a Checkmate-format graph."""
from __future__ import annotations

from memsched.cli.options import add_json_option, positive_seconds
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("remat", help="least-cost recomputation plan for a Checkmate-format graph under a budget")
    p.add_argument("graph", metavar="GRAPH.json",
                   help="networkx node-link JSON, nodes with cost_cpu and cost_ram (or a Moccasin data file as it is)")
    p.add_argument("--budget-fraction", type=float, required=True, metavar="F",
                   help="budget as a fraction of the graph's peak without recomputation (e.g. 0.8)")
    p.add_argument("--time-limit", type=positive_seconds, default=30.0, metavar="S",
                   help="seconds for the whole command (default 30)")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.recompute import dag as remat

    from memsched.deadline import Work, for_command
    from memsched.views import print_remat

    deadline = for_command(args.time_limit)       # the whole command, start-up and loading included
    problem = remat.load_node_link(args.graph)
    budget = remat.budget_from_fraction(problem, args.budget_fraction)
    left = max(deadline.left(), 1e-3)
    result = remat.plan(problem, budget, time_limit_s=left, work=Work(left, deadline), final=True)
    summary = remat.summary(problem, result)
    if args.json:
        print_json(summary)
    else:
        print_remat(summary)
    return 0
