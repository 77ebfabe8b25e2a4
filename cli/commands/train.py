"""`memsched train`: train a model with a compiled plan on real data."""
from __future__ import annotations

import json
import math
import sys

from memsched.cli.options import add_json_option, add_threads_option

from memsched.outputs import check_outputs


def register(sub) -> None:
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
    add_threads_option(p)
    p.add_argument("--nvdimm-dir", metavar="DIR", help="directory for the NVDIMM tier's store (default: a temp dir)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="data parallel: train a plan compiled with --data-parallel N on N local ranks "
                        "(torch.distributed, gloo), each on its own share of the data; under torchrun each process "
                        "is one rank. Rank 0 prints and writes")
    p.add_argument("--sync-batchnorm", action="store_true",
                   help="data parallel: BatchNorm on the whole batch's statistics (as torch's SyncBatchNorm)")
    add_json_option(p, what="print one JSON object per step (step, epoch, loss, lr, seconds), then a summary")
    p.set_defaults(handler=run)


def run(args) -> int:
    import contextlib
    import signal

    from memsched import lr_schedules
    from memsched.data import load_arrays, sample_count, steps_per_epoch
    from memsched.emit import read_plan
    from memsched.errors import UserError
    from memsched.runtime import Trainer
    from memsched.runtime.distributed import launch_command, launched, rank_of
    from memsched.runtime.train_loop import FitOptions, fit
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
