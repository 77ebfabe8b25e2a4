"""memsched's command line: parses arguments, calls the library, prints. No logic of its own."""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys

from memsched.errors import MemschedError
from memsched.onnx_utils import save_model_atomic
from memsched.outputs import Terminated, check_outputs, install_sigterm_handler

# the training step's losses (passes.training.loss.LOSSES, named here so parsing imports no pass)
LOSSES = ["cross_entropy", "mse", "bce_with_logits", "output"]
# ... and optimizers (passes.training.optimizer.OPTIMIZERS)
OPTIMIZERS = ["none", "sgd", "momentum", "adam", "adamw"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    previous = install_sigterm_handler()       # temporaries are removed on the way out, as for Ctrl-C
    try:
        given = list(argv) if argv is not None else sys.argv[1:]
        args = parser.parse_args(attach_negative_values(given))   # a `type=` may raise UserError (a bad value)
        args.argv = given    # a launcher starts ranks with them
        return args.handler(args)
    except MemschedError as exc:
        print(f"memsched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("memsched: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("memsched: terminated", file=sys.stderr)
        return 143
    except OSError as exc:      # a full disk, a file it may not read or write: the system's reason
        print(f"memsched: error: {os_error_line(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug, but the user still gets one line
        if os.environ.get("MEMSCHED_DEBUG"):
            raise
        print(f"memsched: internal error: {type(exc).__name__}: {exc} "
              f"(set MEMSCHED_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
    finally:        # a caller in the same process (a test, a notebook) gets its own handler back
        signal.signal(signal.SIGTERM, previous)
        if argv is None:      # the program itself: a Ctrl-C from here on finds the work over, and
            signal.signal(signal.SIGINT, signal.SIG_IGN)    # must not kill the process (exit -2) on its way out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memsched", description="Plan how a training step uses GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("compile", help="plan a model's memory: reorder, reuse, recompute, swap")
    p.add_argument("model", help="an .onnx file")
    add_dim_option(p)
    p.add_argument("-o", "--output", metavar="OUT.onnx", help="write the scheduled graph (plan in its metadata)")
    add_training_options(p)
    p.add_argument("--hardware", default="v100-16gb", help="preset name or TOML/JSON profile (default v100-16gb)")
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
    p.add_argument("--bucket-mb", type=float, default=25.0, metavar="MB",
                   help="with --data-parallel: gradient bucket size in MiB, as DDP's bucket_cap_mb (default 25)")
    p.add_argument("--report", metavar="OUT.html", help="write the cost report as a self-contained HTML page")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_compile)

    p = sub.add_parser("report", help="the cost report of a scheduled.onnx written by compile -o")
    p.add_argument("plan", help="a scheduled .onnx file (memsched compile -o)")
    p.add_argument("--hardware", help="simulate on this profile instead of the one stored in the plan")
    p.add_argument("--costs", metavar="COSTS.json", help="measured cost table from `memsched profile`")
    p.add_argument("--data-parallel", type=int, metavar="N", help="also estimate N-worker data-parallel steps")
    p.add_argument("--html", metavar="OUT.html", help="write the report as a self-contained HTML page")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_report)

    p = sub.add_parser("tune-batch", help="the largest batch that fits per strategy set, and the fastest per sample")
    p.add_argument("model", help="a bundled model name (memsched models list) or an .onnx file with a symbolic batch")
    add_dim_option(p)
    p.add_argument("--batch-dim", help="the symbolic dimension that is the batch (default: the first one)")
    p.add_argument("--size", type=positive_int("--size"), help="input resolution (bundled image models)")
    p.add_argument("--seq", type=positive_int("--seq"), help="sequence length (bundled transformers)")
    p.add_argument("--hardware", default="v100-16gb", help="preset name or TOML/JSON profile (default v100-16gb)")
    p.add_argument("--budget", help="device bytes to fit instead of the device's memory, e.g. 12GiB")
    p.add_argument("--strategies", action="append", metavar="SET",
                   help="a strategy set to compare, e.g. order,reuse (repeatable; default: none, order,reuse, full)")
    p.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--time-limit", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds for the whole search (default 60); each batch's compile gets 5%% of it")
    p.add_argument("--max-batch", type=positive_int("--max-batch"), default=1 << 16, help="stop the search here")
    p.add_argument("--plot", metavar="OUT.svg", help="write time per sample against batch size")
    p.add_argument("--measure", nargs="?", const="cpu", choices=["cpu", "cuda"],
                   help="run each strategy set's chosen batch with the executor on this device (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_tune_batch)

    p = sub.add_parser("inspect", help="ops, tensors, parameters and the default-order peak of a model")
    p.add_argument("model", help="an .onnx file")
    add_dim_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("models", help="the bundled model zoo: list it, export a model as ONNX")
    models_sub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = models_sub.add_parser("list", help="every bundled model with its parameters at default size")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_models_list)
    p = models_sub.add_parser("export", help="build a bundled model and write it as ONNX")
    p.add_argument("name", help="a model name from `memsched models list`")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write it")
    for flag, meta, what in (("--batch", "N", "batch size"), ("--size", "S", "input resolution"),
                             ("--seq", "L", "sequence length"), ("--classes", "K", "number of classes"),
                             ("--layers", "N", "transformer layers")):
        p.add_argument(flag, type=positive_int(flag), metavar=meta, help=f"{what} (default: the model's)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="weight and activation type")
    p.set_defaults(handler=cmd_models_export)


    p = models_sub.add_parser("digits", help="write scikit-learn's digits as train.npz and test.npz (for train)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write them into")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.set_defaults(handler=cmd_models_digits)

    hw = sub.add_parser("hardware", help="hardware profiles: list, show, calibrate this machine")
    hw_sub = hw.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    p = hw_sub.add_parser("list", help="the bundled profiles")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_hardware_list)
    p = hw_sub.add_parser("show", help="one profile, by preset name or TOML/JSON file")
    p.add_argument("profile", metavar="NAME|FILE")
    p.add_argument("--json", action="store_true", help="print the profile as JSON (a valid profile file)")
    p.set_defaults(handler=cmd_hardware_show)
    p = hw_sub.add_parser("calibrate", help="fit this machine's per-op-class costs with ONNX Runtime timings")
    p.add_argument("-o", "--output", required=True, help="profile file to write (.json)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per op (median)")
    p.add_argument("--threads", type=int, default=1,
                   help="ONNX Runtime intra-op threads (default 1: timed in CPU time, immune to other load)")
    p.add_argument("--references", default="all", metavar="MODELS",
                   help="bundled models whose training steps (small sizes) the class costs are fitted to, "
                        "with the microbenchmarks ('all': every bundled model; '' for none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_hardware_calibrate)

    p = sub.add_parser("profile", help="time every op of a model with ONNX Runtime -> a cost table")
    p.add_argument("model", help="an .onnx file")
    p.add_argument("-o", "--output", required=True, help="cost table to write (.json)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per op (median)")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads (0: its default; 1: timed in CPU time, immune to other load)")
    add_dim_option(p)
    add_training_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_profile)

    p = sub.add_parser("simulate", help="predicted step time of a model's default schedule")
    p.add_argument("model", help="an .onnx file")
    p.add_argument("--hardware", default="cpu", help="preset name or profile file (default: cpu)")
    p.add_argument("--costs", help="a cost table from `memsched profile` (else the roofline)")
    add_dim_option(p)
    add_training_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_simulate)


    p = sub.add_parser("remat", help="least-cost recomputation plan for a Checkmate-format graph under a budget")
    p.add_argument("graph", metavar="GRAPH.json", help="networkx node-link JSON, nodes with cost_cpu and cost_ram")
    p.add_argument("--budget-fraction", type=float, required=True, metavar="F",
                   help="budget as a fraction of the graph's peak without recomputation (e.g. 0.8)")
    p.add_argument("--time-limit", type=positive_seconds, default=30.0, metavar="S",
                   help="seconds for the whole command (default 30)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_remat)

    p = sub.add_parser("train-graph", help="build the training step (forward, loss, backward, update) as ONNX")
    p.add_argument("model", nargs="?", help="an .onnx file (a forward/inference graph); not with --gan")
    p.add_argument("--gan", nargs=2, metavar=("G.onnx", "D.onnx"),
                   help="build one GAN iteration of generator G and discriminator D instead: D's step on 'real' "
                        "and G('z'), then G's step through the updated D (BCE on logits; default optimizer sgd)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the training step")
    add_dim_option(p)
    p.add_argument("--loss", choices=LOSSES,
                   help="cross_entropy against int64 'labels', mse or bce_with_logits against 'targets', or the "
                        "model's scalar output (default: cross_entropy; a GAN step takes bce_with_logits)")
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="none: gradients are outputs; else the update is part of the step (default: none; "
                        "sgd with --gan)")
    p.add_argument("--lr", type=float, default=0.01, metavar="F", help="learning rate (default: 0.01)")
    p.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="do not train parameters matching this fnmatch pattern (repeatable; not with --gan)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_train_graph)

    p = sub.add_parser("check-numerics", help="float32 training-step gradients against the same step in float64")
    p.add_argument("model", help="an .onnx file (a forward graph, or a training step built by train-graph)")
    add_dim_option(p)
    p.add_argument("--loss", choices=LOSSES, default="cross_entropy")
    p.add_argument("--top", type=int, default=10, metavar="N", help="rows to print (default 10)")
    p.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (default: all)")
    p.add_argument("--strict", action="store_true",
                   help="let the float64 run take its own ReLU masks and max-pool choices (by default it takes "
                        "the float32 run's, so that both differentiate the same piece of the step)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_check_numerics)

    p = sub.add_parser("doctor", help="can plans run on CUDA here: providers, GPU, CUDA libraries, and the fix")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_doctor)

    p = sub.add_parser("train", help="train a model with a compiled plan on real data; write the trained model")
    p.add_argument("plan", help="a scheduled .onnx of a training step (memsched compile --train -o)")
    p.add_argument("--data", required=True, metavar="TRAIN.npz",
                   help="one array per input of the step (the model's inputs and labels/targets), samples first")
    p.add_argument("--val", metavar="VAL.npz", help="validation data: loss (and accuracy) after every epoch")
    p.add_argument("--epochs", type=int, default=1, metavar="N", help="epochs to train (default 1)")
    p.add_argument("--lr", type=float, metavar="LR", help="learning rate (default: the one the plan was compiled with)")
    p.add_argument("--lr-schedule", metavar="S",
                   help="constant (default), step:EVERY:GAMMA, cosine[:MIN] or warmup:N,<schedule>; in steps")
    p.add_argument("--shuffle", action="store_true", help="shuffle the samples every epoch")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default 0)")
    p.add_argument("--last", choices=("drop", "pad"), default="drop",
                   help="the last partial batch of an epoch: dropped (default) or filled up with the epoch's first "
                        "samples; the batch size is the plan's")
    p.add_argument("--init", metavar="WEIGHTS",
                   help="start from these weights: an .onnx model or a .safetensors file (names as in the model)")
    p.add_argument("--save", metavar="MODEL.onnx",
                   help="write the trained inference model (plain ONNX Runtime runs it)")
    p.add_argument("--checkpoint", metavar="CKPT.safetensors",
                   help="write a checkpoint after every epoch and on Ctrl-C (and its loss curve beside it)")
    p.add_argument("--resume", metavar="CKPT.safetensors", help="continue from a checkpoint")
    p.add_argument("--plot", metavar="OUT.svg", help="write the loss curve here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to run (default cpu)")
    p.add_argument("--allow-fallback", action="store_true",
                   help="with --device cuda: train on the CPU when CUDA is not usable instead of failing")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads (default 0: every core)")
    p.add_argument("--nvdimm-dir", metavar="DIR", help="directory for the NVDIMM tier's store (default: a temp dir)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="data parallel: train a plan compiled with --data-parallel N on N local ranks "
                        "(torch.distributed, gloo), each on its own share of the data; under torchrun each process "
                        "is one rank. Rank 0 prints and writes")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="data parallel: BatchNorm on the whole batch's statistics (as torch's SyncBatchNorm)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per step (step, epoch, loss, lr, seconds), then a summary")
    p.set_defaults(handler=cmd_train)

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
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime intra-op threads (default 0: every core, as ONNX Runtime does; 1 for timing)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="data parallel: start N local ranks (torch.distributed, gloo) on a plan compiled with "
                        "--data-parallel N; under torchrun each process is one rank")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="data parallel: BatchNorm on the whole batch's statistics, averaged across the ranks "
                        "(as torch's SyncBatchNorm); by default each rank normalises with its own batch's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_run)
    return parser


def os_error_line(exc: OSError) -> str:
    """'cannot open PATH: Permission denied': the file and the system's reason, as other tools
    say it (a failed write is the writers' UserError, its temporary removed)."""
    reason = exc.strerror or str(exc)
    return f"cannot open {exc.filename}: {reason}" if exc.filename else reason


def attach_negative_values(argv: list[str]) -> list[str]:
    """`--budget -5%` as `--budget=-5%`: argparse reads a value that starts with '-' and is not a
    plain number as an option ("expected one argument"); attached, the option's own check
    refuses it with its reason."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-[0-9.][^\s]*", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def positive_int(what: str):
    """argparse type for a count or size named `what`: an integer above 0 (not an integer:
    argparse's usage error; 0 or less: a UserError, one line and exit 1)."""
    def parse(text: str) -> int:
        from memsched.errors import UserError

        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < 1:
            raise UserError(f"{what} '{text}' must be a whole number of at least 1")
        return value

    parse.__name__ = "integer"      # argparse's usage error names the type
    return parse


def positive_seconds(text: str) -> float:
    """argparse type for a time limit: a finite number of seconds above 0.

    Not a number: argparse's usage error (exit 2), as for any unreadable option. A number out of
    range ('0', '-1', 'nan', 'inf'): a UserError, one line and exit 1, as for other bad values."""
    from memsched.errors import UserError

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"time limit '{text}' must be a finite number of seconds above 0")
    return value


def add_dim_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", action="append", metavar="NAME=VALUE", default=[],
                   help="bind a symbolic dimension (repeatable)")


def add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", action="store_true", help="plan the training step (forward, loss, backward, update)")
    p.add_argument("--loss", default="cross_entropy", choices=LOSSES)
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01; a trainer may change it)")
    p.add_argument("--momentum", type=float, default=0.9, help="with --optimizer momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=0.0,
                   help="SGD/Adam: L2 penalty in the gradient; AdamW: decoupled decay (default 0: no decay ops)")
    p.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="parameters matching this fnmatch pattern are not trained (repeatable)")


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
    import models
    from memsched.views import print_models

    entries = models.catalog()
    if args.json:
        print_json({"models": entries})
    else:
        print_models(entries)
    return 0


def cmd_models_export(args) -> int:
    import models
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
    from models.digits import TRAIN_SAMPLES, write

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
    from passes.calibration import DEFAULT_REFERENCES, reference_graphs

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
    from passes.pipeline import load_graph

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
    from passes.pipeline import load_graph

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
    from memsched.emit import write_plan
    from memsched.interrupt import stop_on_interrupt
    from memsched.views import progress, say_interrupted
    from passes.pipeline import compile as compile_plan

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
                              deadline=deadline)
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
    from passes.pipeline import assess, baseline_of, strategies_of

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
    from passes.recompute import dag as remat

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
    from passes.training import build_training_step

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
    from passes.training import build_training_step, describe
    from passes.training.gan import build_gan_step

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
    from passes.pipeline import parse_strategies
    from memsched.deadline import for_command
    from passes.tune import STRATEGY_SETS, graph_builder, tune_batch

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
    from memsched.distributed import launched
    from memsched.emit import read_plan
    from passes.rebuild import model_step
    from memsched.errors import UserError
    from memsched.executor import run_plan
    from memsched.summary import predicted_step_time, run_summary
    from memsched.views import print_run, step_progress
    from passes.rewrites.batch_split import given_graph

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
    summary = {**run_summary(result, args.plan, predicted_step_time(plan, device)),
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
    from memsched.distributed import launch_command, launched, rank_of
    from memsched.emit import read_plan
    from memsched.errors import UserError
    from memsched.train_loop import FitOptions, fit
    from memsched.trainer import Trainer
    from memsched.views import print_train, train_progress

    if args.workers is not None and not launched():
        return launch_command(__file__, ["train", *_without_option(args.argv, "--workers")], args.workers)
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
    """`run --workers N`, or one rank under torchrun: a data-parallel run (memsched.distributed)."""
    from memsched.distributed import launch, launched, run_rank
    from memsched.emit import read_plan
    from memsched.errors import UserError

    used = [flag for flag, given in (("--check", args.check), ("--device cuda", args.device == "cuda"),
                                     ("--nvdimm-dir", args.nvdimm_dir)) if given]
    if used:
        raise UserError(f"a data-parallel run (--workers, torchrun) runs on the CPU without {used[0]}")
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


if __name__ == "__main__":
    sys.exit(main())
