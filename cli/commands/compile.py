"""`memsched compile`: plan a model's memory and write the plan and its report."""
from __future__ import annotations

import math

from memsched.cli.options import (add_dim_option, add_hardware_option, add_json_option, add_training_options,
                                   check_training_options, positive_seconds)
from memsched.cli.render import show_report

from memsched.outputs import check_outputs

BUCKET_MB = 25.0        # DDP's bucket_cap_mb


def register(sub) -> None:
    p = sub.add_parser("compile", help="plan a model's memory: reorder, reuse, recompute, swap")
    p.add_argument("model", help="an .onnx file")
    add_dim_option(p)
    p.add_argument("-o", "--output", metavar="OUT.onnx", help="write the scheduled graph (plan in its metadata)")
    add_training_options(p)
    add_hardware_option(p)
    p.add_argument("--budget", help="device bytes the plan must fit: 12GiB, 800MB, or 40%% of the baseline peak")
    p.add_argument("--strategies",
                   help="comma-separated, from order,reuse,recompute,swap (default: all four with --budget, "
                        "else order,reuse); recompute and swap run only while the plan is over the budget")
    p.add_argument("--time-limit", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds for the whole compile (default 60); Ctrl-C keeps the best plan so far")
    p.add_argument("--costs", metavar="COSTS.json", help="measured cost table from `memsched profile`")
    p.add_argument("--data-parallel", type=int, metavar="N",
                   help="plan the step of one of N data-parallel workers (with --train: 1/N of the batch each) "
                        "and estimate its all-reduces")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB, metavar="MB",
                   help="with --data-parallel: gradient bucket size in MiB, as DDP's bucket_cap_mb (default 25)")
    p.add_argument("--report", metavar="OUT.html", help="write the cost report as a self-contained HTML page")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.pipeline import compile as compile_plan

    from memsched import frontend
    from memsched.deadline import for_command
    from memsched.emit import write_plan, write_seconds
    from memsched.errors import UserError
    from memsched.interrupt import stop_on_interrupt
    from memsched.report import staged_html
    from memsched.views import progress, say_interrupted

    check_outputs({"-o": args.output, "--report": args.report}, [args.model, args.costs, args.hardware])
    check_training_options(args)
    if not math.isfinite(args.bucket_mb) or args.bucket_mb <= 0:
        raise UserError(f"--bucket-mb must be a size above 0 MiB, not {args.bucket_mb:g}")
    if args.bucket_mb != BUCKET_MB and args.data_parallel is None:
        raise UserError("--bucket-mb sizes the gradient buckets of a data-parallel step; add --data-parallel N")
    deadline = for_command(args.time_limit)     # from the process's start: the whole command
    # the first Ctrl-C, during the search or while the plan and report are written, finishes
    # with the best plan (exit 0); a second aborts (exit 130), the writes being atomic
    with stop_on_interrupt(deadline, say_interrupted):
        with progress(deadline) as say:
            result = compile_plan(args.model, dims=frontend.parse_dims(args.dim), train=args.train,
                                  loss=args.loss, optimizer=args.optimizer, lr=args.lr, freeze=tuple(args.freeze),
                                  training_options={"momentum": args.momentum, "weight_decay": args.weight_decay},
                                  hardware=args.hardware, budget=args.budget, strategies=args.strategies,
                                  time_limit=args.time_limit, costs=args.costs, data_parallel=args.data_parallel,
                                  bucket_bytes=max(1, int(args.bucket_mb * 1024 * 1024)), progress=say,
                                  deadline=deadline, reserve=write_seconds if args.output else None)
        with staged_html(args.report, result) as report:       # the plan and the report land together
            written = {"plan": str(write_plan(result.plan, args.output))} if args.output else {}
        written.update({"report": str(report)} if report else {})
        return show_report(result, None, written, args.json)
