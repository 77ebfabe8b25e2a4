"""The command line's grammar: every command, its options and their checks (argparse)."""
from __future__ import annotations

import argparse
import math
import re

from memsched.cli.commands import (cmd_check_numerics, cmd_compile, cmd_doctor, cmd_hardware_calibrate,
                                   cmd_hardware_list, cmd_hardware_show, cmd_inspect, cmd_models_digits,
                                   cmd_models_export, cmd_models_list, cmd_profile, cmd_remat, cmd_report, cmd_run,
                                   cmd_simulate, cmd_train, cmd_train_graph, cmd_tune_batch)

# the training step's losses (passes.training.loss.LOSSES, named here so parsing imports no pass)
LOSSES = ["cross_entropy", "mse", "bce_with_logits", "output"]
# ... and optimizers (passes.training.optimizer.OPTIMIZERS)
OPTIMIZERS = ["none", "sgd", "momentum", "adam", "adamw"]


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
    p.add_argument("--hardware", metavar="PROFILE",
                   help="the profile the predicted step time uses, e.g. one `hardware calibrate` wrote here "
                        "(default: the bundled cpu profile on the CPU, the plan's on CUDA)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="data parallel: start N local ranks (torch.distributed, gloo) on a plan compiled with "
                        "--data-parallel N; under torchrun each process is one rank")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="data parallel: BatchNorm on the whole batch's statistics, averaged across the ranks "
                        "(as torch's SyncBatchNorm); by default each rank normalises with its own batch's")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_run)
    return parser


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
