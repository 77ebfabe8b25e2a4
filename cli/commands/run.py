"""`memsched run`: run a plan with the bundled executor and measure it (data parallel too)."""
from __future__ import annotations

import sys

from memsched.cli.options import add_hardware_option, add_json_option, add_threads_option
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("run", help="run a scheduled plan with the bundled executor and measure it")
    p.add_argument("plan", help="a scheduled .onnx written by memsched")
    p.add_argument("--steps", type=int, default=1, help="training steps to run (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    p.add_argument("--allow-fallback", action="store_true",
                   help="with --device cuda: run on the CPU when CUDA is not usable instead of failing")
    p.add_argument("--check", action="store_true",
                   help="compare every output with a plain ONNX Runtime run of the unscheduled graph")
    p.add_argument("--against", metavar="MODEL.onnx",
                   help="with --check: also rebuild MODEL's step with the plan's training options and compare "
                        "every output with a plain run of it, within a tolerance (MODEL's own weights)")
    p.add_argument("--nvdimm-dir", metavar="DIR", help="directory for the NVDIMM tier's store (default: a temp dir)")
    add_threads_option(p)
    add_hardware_option(p, default=None, what="the profile of the predicted step time, e.g. one `hardware calibrate` "
                        "wrote here", shown="the bundled cpu profile on the CPU, the plan's on CUDA")
    p.add_argument("--workers", type=int, metavar="N",
                   help="data parallel: start N local ranks (torch.distributed, gloo) on a plan compiled with "
                        "--data-parallel N; under torchrun each process is one rank")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="data parallel: BatchNorm on the whole batch's statistics, averaged across the ranks "
                        "(as torch's SyncBatchNorm); by default each rank normalises with its own batch's")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.rebuild import model_step
    from memsched.passes.rewrites.batch_split import given_graph

    from memsched.emit import read_plan
    from memsched.errors import UserError
    from memsched.runtime import run_plan
    from memsched.runtime.distributed import launched
    from memsched.summary import predicted_step_time, run_summary
    from memsched.views import print_run, step_progress

    if args.against and not args.check:
        raise UserError("--against compares the plan's outputs with the model's; give --check with it")
    if args.workers is not None or launched():
        return run_workers(args)
    if args.sync_batchnorm:
        raise UserError("--sync-batchnorm goes with a data-parallel run: give --workers N (or run under torchrun)")
    plan = read_plan(args.plan)
    given = given_graph(plan.graph) if args.check else plan.graph     # only a check runs the model as given
    against = model_step(plan, args.against) if args.against else None
    bar = args.steps > 1 and sys.stdout.isatty() and not args.json
    with step_progress(args.steps, enabled=bar) as progress:
        result = run_plan(plan, steps=args.steps, device=args.device, check=args.check,
                          nvdimm_dir=args.nvdimm_dir, progress=progress, threads=args.threads,
                          given=given if given is not plan.graph else None, allow_fallback=args.allow_fallback,
                          against=against)
    device = "cuda" if result.provider.startswith("CUDA") else "cpu"
    summary = {**run_summary(result, args.plan, predicted_step_time(plan, device, args.hardware)),
               "threads": result.threads, "process": result.process}
    if against is not None:
        summary["check"]["against"]["model"] = args.against
    if args.json:
        print_json(summary)
    else:
        print_run(summary)
    check = summary["check"]
    for failed, reference in ((check, "the plain ONNX Runtime run"),
                              (check and check["given"], "a plain run of the model as given"),
                              (check and check["against"], f"a plain run of the step rebuilt from {args.against}")):
        if failed and not failed["passed"] and failed.get("non_finite"):
            print(f"memsched: error: check failed: output '{failed['non_finite'][0]}' holds NaN or infinite values "
                  f"({len(failed['non_finite'])} outputs do); the step diverged (a learning rate too large?)",
                  file=sys.stderr)
            return 1
        if failed and not failed["passed"]:
            worst = max(failed["per_output"], key=failed["per_output"].get)
            within = "" if failed["exact"] else f" (tolerance {failed['tolerance']:g})"
            print(f"memsched: error: check failed: output '{worst}' differs from {reference} "
                  f"by up to {failed['max_abs_diff']:.3g}{within}", file=sys.stderr)
            return 1
    return 0


def run_workers(args) -> int:
    """`run --workers N`, or one rank under torchrun: a data-parallel run (memsched.runtime.distributed)."""
    from memsched.emit import read_plan
    from memsched.errors import UserError
    from memsched.runtime.distributed import launch, launched, rank_and_world, run_rank
    from memsched.views import print_data_parallel_run

    used = [flag for flag, given in (("--check", args.check), ("--device cuda", args.device == "cuda"),
                                     ("--nvdimm-dir", args.nvdimm_dir)) if given]
    if used:
        raise UserError(f"a data-parallel run (--workers, torchrun) runs on the CPU without {used[0]}")
    if args.hardware:
        raise UserError("--hardware is for a run in one process; a data-parallel run predicts with the cpu profile")
    if launched():
        _, world = rank_and_world()
        if args.workers is not None and args.workers != world:
            raise UserError(f"--workers {args.workers} but torchrun started {world} processes")
        summary, _ = run_rank(read_plan(args.plan), steps=args.steps, threads=args.threads, path=args.plan,
                              sync_batchnorm=args.sync_batchnorm)
        if summary is None:              # another rank than 0: rank 0 reports
            return 0
    else:
        summary = launch(args.plan, args.workers, steps=args.steps, threads=args.threads,
                         sync_batchnorm=args.sync_batchnorm)
    if args.json:
        print_json(summary)
        return 0
    print_data_parallel_run(summary, args.sync_batchnorm)
    return 0
