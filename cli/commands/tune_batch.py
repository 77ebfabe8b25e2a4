"""`memsched tune-batch`: the largest batch per strategy set and the fastest per sample."""
from __future__ import annotations

from memsched.cli.options import (LOSSES, OPTIMIZERS, add_dim_option,
                                   add_hardware_option, add_json_option, positive_int, positive_seconds)
from memsched.cli.render import print_json

from memsched.outputs import check_outputs


def register(sub) -> None:
    p = sub.add_parser("tune-batch", help="the largest batch that fits per strategy set, and the fastest per sample")
    p.add_argument("model", help="a bundled model name (memsched models list) or an .onnx file with a symbolic batch")
    add_dim_option(p)
    p.add_argument("--batch-dim", help="the symbolic dimension that is the batch (default: the first one)")
    p.add_argument("--size", type=positive_int("--size"), help="input resolution (bundled image models)")
    p.add_argument("--seq", type=positive_int("--seq"), help="sequence length (bundled transformers)")
    add_hardware_option(p)
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
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.pipeline import parse_strategies
    from memsched.passes.tune import STRATEGY_SETS, graph_builder, tune_batch

    from memsched import frontend
    from memsched.deadline import for_command
    from memsched.figures import batch_curve_svg
    from memsched.onnx_utils import write_text_atomic
    from memsched.views import print_tune, progress

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
