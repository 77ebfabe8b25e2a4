"""`memsched report`: the cost report of a written plan, judged and simulated again."""
from __future__ import annotations

from memsched.cli.options import add_hardware_option, add_json_option, positive_int
from memsched.cli.render import show_report

from memsched.outputs import check_outputs


def register(sub) -> None:
    p = sub.add_parser("report", help="the cost report of a scheduled.onnx written by compile -o")
    p.add_argument("plan", help="a scheduled .onnx file (memsched compile -o)")
    add_hardware_option(p, default=None, what="simulate on this profile instead of the plan's")
    p.add_argument("--costs", metavar="COSTS.json", help="measured cost table from `memsched profile`")
    p.add_argument("--data-parallel", type=positive_int("--data-parallel"), metavar="N",
                   help="also estimate N-worker data-parallel steps")
    p.add_argument("--html", metavar="OUT.html", help="write the report as a self-contained HTML page")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    import dataclasses

    from memsched.passes.pipeline import assess, baseline_of, strategies_of

    from memsched import hardware
    from memsched.emit import read_plan

    check_outputs({"--html": args.html}, [args.plan, args.costs, args.hardware])
    plan = read_plan(args.plan)
    if args.hardware:
        plan = dataclasses.replace(plan, hardware=hardware.load(args.hardware))
    elif plan.hardware is None:
        plan = dataclasses.replace(plan, hardware=hardware.load(hardware.PLANNING_PROFILE))
    result = assess(plan, baseline_of(plan), strategies_of(plan), {}, args.plan,
                    costs=args.costs, data_parallel=args.data_parallel)
    return show_report(result, args.html, {}, args.json)
