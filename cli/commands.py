"""The commands: each calls the library and prints its answer (a table, or JSON with --json)."""
from __future__ import annotations

import json
import math
import os
import sys

from memsched.onnx_utils import save_model_atomic
from memsched.outputs import check_outputs


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def cmd_inspect(args) -> int:
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


def cmd_models_list(args) -> int:
    from memsched import models
    from memsched.views import print_models

    entries = models.catalog()
    if args.json:
        print_json({"models": entries})
    else:
        print_models(entries)
    return 0


def cmd_models_export(args) -> int:
    from memsched import models
    from memsched.errors import UserError

    check_outputs({"-o": args.output})
    extra = {} if args.layers is None else {"layers": args.layers}
    try:
        model = models.build(args.name, batch=args.batch, size=args.size, seq=args.seq,
                             classes=args.classes, dtype=args.dtype, **extra)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    path = save_model_atomic(model, args.output)
    print(f"wrote {path}: {args.name}, {models.count_parameters(model):,} parameters")
    return 0


def cmd_models_digits(args) -> int:
    from memsched.models.digits import TRAIN_SAMPLES, write

    train, test = write(args.output, args.seed)
    print(f"wrote {train} ({TRAIN_SAMPLES} samples) and {test}: 8x8 images as 'input', their digits as 'labels'")
    return 0


def cmd_hardware_list(args) -> int:
    from memsched import hardware
    from memsched.errors import UserError
    from memsched.views import print_hardware_list

    rows = []
    for name in hardware.preset_names():
        try:
            rows.append(hardware.load(name).to_dict())
        except UserError as exc:           # a measured preset not made on this install
            rows.append({"name": name, "error": str(exc)})
    if args.json:
        print_json({"profiles": rows})
    else:
        print_hardware_list(rows)
    return 0


def cmd_hardware_show(args) -> int:
    from memsched import hardware
    from memsched.views import print_hardware

    profile = hardware.load(args.profile).to_dict()
    if args.json:
        print_json(profile)
    else:
        print_hardware(profile)
    return 0


def cmd_hardware_calibrate(args) -> int:
    from memsched.measure import calibrate
    from memsched.onnx_utils import write_text_atomic
    from memsched.views import print_hardware
    from memsched.passes.calibration import DEFAULT_REFERENCES, reference_graphs

    check_outputs({"-o": args.output})
    names = DEFAULT_REFERENCES if args.references == "all" else [n.strip() for n in args.references.split(",")]
    references = reference_graphs([n for n in names if n])
    hw, rows = calibrate(repeats=args.repeats, threads=args.threads, references=references)
    profile = {**hw.to_dict(), "calibration": rows}
    write_text_atomic(args.output, json.dumps(profile, indent=1) + "\n")
    if args.json:
        print_json({**profile, "path": args.output})
    else:
        print_hardware(profile)
        print(f"written to {args.output}")
    return 0


def cmd_profile(args) -> int:
    from memsched import frontend
    from memsched.measure import profile_graph
    from memsched.views import print_cost_table
    from memsched.passes.pipeline import load_graph

    check_outputs({"-o": args.output}, [args.model])
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


def cmd_simulate(args) -> int:
    from memsched import frontend
    from memsched.cost import CostTable
    from memsched.schedule import Plan
    from memsched.simulate import simulate
    from memsched.views import print_simulation
    from memsched.passes.pipeline import load_graph

    graph = load_graph(args.model, frontend.parse_dims(args.dim), args.train, args.loss, args.optimizer, args.lr,
                       tuple(args.freeze))
    costs = CostTable.load(args.costs) if args.costs else None
    result = simulate(Plan.initial(graph), args.hardware, costs).to_dict()
    if args.json:
        print_json(result)
    else:
        print_simulation(result)
    return 0


def cmd_compile(args) -> int:
    from memsched import frontend
    from memsched.errors import UserError
    from memsched.deadline import for_command
    from memsched.emit import write_plan, write_seconds
    from memsched.interrupt import stop_on_interrupt
    from memsched.views import progress, say_interrupted
    from memsched.passes.pipeline import compile as compile_plan

    check_outputs({"-o": args.output, "--report": args.report}, [args.model, args.costs, args.hardware])
    if not math.isfinite(args.bucket_mb) or args.bucket_mb <= 0:
        raise UserError(f"--bucket-mb must be a size above 0 MiB, not {args.bucket_mb:g}")
    deadline = for_command(args.time_limit)     # from the process's start: the whole command
    with progress(deadline) as say, stop_on_interrupt(deadline, say_interrupted):
        result = compile_plan(args.model, dims=frontend.parse_dims(args.dim), train=args.train, loss=args.loss,
                              optimizer=args.optimizer, lr=args.lr, freeze=tuple(args.freeze),
                              training_options={"momentum": args.momentum, "weight_decay": args.weight_decay},
                              hardware=args.hardware, budget=args.budget, strategies=args.strategies,
                              time_limit=args.time_limit, costs=args.costs, data_parallel=args.data_parallel,
                              bucket_bytes=max(1, int(args.bucket_mb * 1024 * 1024)), progress=say,
                              deadline=deadline, reserve=write_seconds if args.output else None)
    written = {"plan": str(write_plan(result.plan, args.output))} if args.output else {}
    return show_report(result, args.report, written, args.json)


def show_report(result, html_path: str | None, written: dict, as_json: bool) -> int:
    """Write the HTML report if asked, then print the report (JSON or the terminal summary)."""
    from memsched.report import write_html
    from memsched.views import print_compile

    if html_path:
        written["report"] = str(write_html(html_path, result.report, result.baseline_sim.to_dict(),
                                           result.sim.to_dict()))
    report = {**result.report, "written": written}
    if as_json:
        print_json(report)
    else:
        print_compile(report)
    return 0


def cmd_report(args) -> int:
    import dataclasses

    from memsched import hardware
    from memsched.emit import read_plan
    from memsched.passes.pipeline import assess, baseline_of, strategies_of

    check_outputs({"--html": args.html}, [args.plan, args.costs, args.hardware])
    plan = read_plan(args.plan)
    if args.hardware:
        plan = dataclasses.replace(plan, hardware=hardware.load(args.hardware))
    elif plan.hardware is None:
        plan = dataclasses.replace(plan, hardware=hardware.load("v100-16gb"))
    result = assess(plan, baseline_of(plan), strategies_of(plan), {}, args.plan,
                    costs=args.costs, data_parallel=args.data_parallel)
    return show_report(result, args.html, {}, args.json)


def cmd_remat(args) -> int:
    from memsched.deadline import Work, for_command
    from memsched.views import print_remat
    from memsched.passes.recompute import dag as remat

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


def cmd_check_numerics(args) -> int:
    from memsched import frontend, numerics
    from memsched.passes.training import build_training_step

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


def cmd_train_graph(args) -> int:
    from memsched import frontend
    from memsched.errors import UserError
    from memsched.onnx_utils import save_model_atomic
    from memsched.views import print_train_graph
    from memsched.passes.training import build_training_step, describe
    from memsched.passes.training.gan import build_gan_step

    dims = frontend.parse_dims(args.dim)
    if args.gan:
        if args.model or args.freeze or args.loss not in (None, "bce_with_logits"):
            raise UserError("--gan G.onnx D.onnx takes no MODEL, --freeze or --loss (its loss is bce_with_logits)")
        check_outputs({"-o": args.output}, list(args.gan))
        generator, discriminator = (frontend.load(path, dims) for path in args.gan)
        train = build_gan_step(generator, discriminator, optimizer=args.optimizer or "sgd", lr=args.lr)
    else:
        if not args.model:
            raise UserError("give a MODEL.onnx, or --gan G.onnx D.onnx")
        check_outputs({"-o": args.output}, [args.model])
        train = build_training_step(frontend.load(args.model, dims), loss=args.loss or "cross_entropy",
                                    optimizer=args.optimizer or "none", lr=args.lr, freeze=args.freeze)
    save_model_atomic(train.to_onnx(), args.output)
    summary = {"output": str(args.output), **describe(train)}
    if args.json:
        print_json(summary)
    else:
        print_train_graph(summary)
    return 0


def cmd_tune_batch(args) -> int:
    from memsched import frontend
    from memsched.figures import batch_curve_svg
    from memsched.onnx_utils import write_text_atomic
    from memsched.views import print_tune, progress
    from memsched.passes.pipeline import parse_strategies
    from memsched.deadline import for_command
    from memsched.passes.tune import STRATEGY_SETS, graph_builder, tune_batch

    check_outputs({"--plot": args.plot}, [args.model, args.hardware])
    sets = STRATEGY_SETS if not args.strategies else \
        {text: parse_strategies(text if text != "none" else ()) for text in args.strategies}
    build = graph_builder(args.model, frontend.parse_dims(args.dim), args.batch_dim, args.size, args.seq)
    deadline = for_command(args.time_limit)
    with progress(deadline) as say:
        result = tune_batch(build, hardware=args.hardware, budget=args.budget, strategy_sets=sets, loss=args.loss,
                            optimizer=args.optimizer, time_limit=args.time_limit, max_batch=args.max_batch,
                            progress=say, measure=args.measure, deadline=deadline,
                            measure_build=graph_builder(args.model, frontend.parse_dims(args.dim), args.batch_dim,
                                                        args.size, args.seq, weights=True) if args.measure else None)
    out = result.to_dict()
    if args.plot:
        out["plot"] = str(write_text_atomic(args.plot, batch_curve_svg(result.rows)))
    if args.json:
        print_json(out)
    else:
        print_tune(out)
    return 0


def cmd_doctor(args) -> int:
    from memsched.doctor import diagnose
    from memsched.views import print_doctor

    report = diagnose()
    if args.json:
        print_json(report)
    else:
        print_doctor(report)
    return 0


def cmd_run(args) -> int:
    from memsched.runtime.distributed import launched
    from memsched.emit import read_plan
    from memsched.passes.rebuild import model_step
    from memsched.errors import UserError
    from memsched.runtime import run_plan
    from memsched.summary import predicted_step_time, run_summary
    from memsched.views import print_run, step_progress
    from memsched.passes.rewrites.batch_split import given_graph

    if args.against and not args.check:
        raise UserError("--against compares the plan's outputs with the model's; give --check with it")
    if args.workers is not None or launched():
        return cmd_run_workers(args)
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


def cmd_train(args) -> int:
    import contextlib
    import signal

    from memsched import lr_schedules
    from memsched.data import load_arrays, sample_count, steps_per_epoch
    from memsched.runtime.distributed import launch_command, launched, rank_of
    from memsched.emit import read_plan
    from memsched.errors import UserError
    from memsched.runtime.train_loop import FitOptions, fit
    from memsched.runtime import Trainer
    from memsched.views import print_train, train_progress

    if args.workers is not None and not launched():
        return launch_command(["train", *_without_option(args.argv, "--workers")], args.workers)
    check_outputs({"--save": args.save, "--checkpoint": args.checkpoint, "--plot": args.plot},
                  [args.plan, args.data, args.val, args.init])
    if args.epochs < 1:
        raise UserError(f"--epochs must be at least 1, not {args.epochs}")
    if args.lr is not None and not (math.isfinite(args.lr) and 0 < args.lr < 1e6):
        raise UserError(f"--lr must be a positive number below 1e6, not {args.lr:g}")
    if args.resume and args.init:
        raise UserError("--resume continues a run from its checkpoint; --init starts a new one: give one of them")
    if args.sync_batchnorm and not launched():
        raise UserError("--sync-batchnorm goes with a data-parallel run: give --workers N (or run under torchrun)")
    plan = read_plan(args.plan)
    stop = {"asked": False}

    def interrupt(signum, frame):          # the first Ctrl-C stops after this step; a second aborts
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True

    with contextlib.ExitStack() as stack:
        rank, world, comm, _ = stack.enter_context(rank_of(plan, sync_batchnorm=args.sync_batchnorm)) \
            if launched() else (0, 1, None, None)
        before, after = (comm.before, comm.after) if comm is not None else (None, None)
        lead = rank == 0                   # rank 0 prints and writes; every rank trains on its share
        trainer = stack.enter_context(Trainer(plan, device=args.device, threads=args.threads,
                                              nvdimm_dir=args.nvdimm_dir, allow_fallback=args.allow_fallback,
                                              before=before, after=after))
        train = load_arrays(args.data, trainer.input_types)
        val = load_arrays(args.val, trainer.input_types) if args.val and lead else None
        total = args.epochs * steps_per_epoch(sample_count(train), trainer.batch_size, args.last, world)
        base = args.lr if args.lr is not None else trainer.hyperparameters.get("lr", 0.0)
        if args.lr is not None or args.lr_schedule:
            trainer.lr_schedule = lr_schedules.parse(args.lr_schedule, base, total)
        if args.init:
            trainer.load_weights(args.init)
        options = FitOptions(epochs=args.epochs, shuffle=args.shuffle, seed=args.seed, last=args.last,
                             checkpoint=args.checkpoint if lead else None, save=args.save if lead else None,
                             plot=args.plot if lead else None, resume=args.resume, rank=rank, world=world)
        on_step = (lambda record: print(json.dumps({k: record[k] for k in ("step", "epoch", "batch", "loss", "lr",
                                                                             "seconds")}), flush=True)) \
            if args.json and lead else None
        if world == 1:                     # ranks stop together only by failing: Ctrl-C ends them all
            previous = signal.signal(signal.SIGINT, interrupt)
            stack.callback(signal.signal, signal.SIGINT, previous)
        with train_progress(total, trainer.batch_size, lead and sys.stdout.isatty() and not args.json) as bar:
            result = fit(trainer, train, options, val, on_step=on_step or bar, stop=lambda: stop["asked"])
        summary = {"plan": args.plan, "provider": trainer.device, "fallback": trainer.fallback, "workers": world,
                   "steps": result.steps, "first_step": result.first_step, "epochs_done": result.epochs_done,
                   "stopped": result.stopped, "final_loss": result.losses[-1] if result.losses else None,
                   "seconds": result.seconds, "samples_per_second": result.samples_per_second * world,
                   "validation": result.validation, "written": result.written}
    if not lead:
        return 0
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        print_train(summary)
    return 0


def _without_option(argv: list[str], option: str) -> list[str]:
    """The arguments of command line `argv` after its command, without `option` and its value
    (`--workers 2` or `--workers=2`)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(f"{option}="):
            kept.append(arg)
    return kept[1:]          # the command's own arguments (argv[0] is the command)


def cmd_run_workers(args) -> int:
    """`run --workers N`, or one rank under torchrun: a data-parallel run (memsched.runtime.distributed)."""
    from memsched.runtime.distributed import launch, launched, run_rank
    from memsched.emit import read_plan
    from memsched.errors import UserError

    used = [flag for flag, given in (("--check", args.check), ("--device cuda", args.device == "cuda"),
                                     ("--nvdimm-dir", args.nvdimm_dir)) if given]
    if used:
        raise UserError(f"a data-parallel run (--workers, torchrun) runs on the CPU without {used[0]}")
    if args.hardware:
        raise UserError("--hardware is for a run in one process; a data-parallel run predicts with the cpu profile")
    if launched():
        world = int(os.environ["WORLD_SIZE"])
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
    measured, predicted = summary["measured"], summary["predicted"]
    print(f"ran {summary['steps']} step(s) of {summary['plan']} on {summary['workers']} workers "
          f"({summary['backend']}, {len(summary['buckets'])} gradient buckets)")
    print(f"{'':24}{'measured':>16}{'predicted':>16}")
    rows = (("peak bytes per worker", "peak_bytes", "{:,}"), ("step time (s)", "step_time_s", "{:.6f}"),
            ("all-reduce wait (s)", "allreduce_wait_s", "{:.6f}"), ("all-reduce time (s)", "allreduce_s", "{:.6f}"),
            ("overlap fraction", "overlap_fraction", "{:.3f}"))
    for label, key, form in rows:
        print(f"{label:24}{form.format(measured[key]):>16}{form.format(predicted[key]):>16}")
    if args.sync_batchnorm:
        print(f"BatchNorm on the whole batch: {summary['synchronised_batch_statistics']} per-channel statistics "
              f"averaged across the workers")
    print(f"predicted step without overlap: {predicted['step_no_overlap_s']:.6f} s (the cpu profile, "
          f"{predicted['interconnect']['bandwidth'] / 1e9:g} GB/s interconnect)")
    return 0
