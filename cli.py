"""memsched's command line: parses arguments, calls the library, prints. No logic of its own."""
from __future__ import annotations

import argparse
import json
import os
import sys

from memsched.errors import MemschedError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except MemschedError as exc:
        print(f"memsched: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("memsched: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug, but the user still gets one line
        if os.environ.get("MEMSCHED_DEBUG"):
            raise
        print(f"memsched: internal error: {type(exc).__name__}: {exc} "
              f"(set MEMSCHED_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memsched", description="Plan how a training step uses GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", help="ops, tensors, parameters and the default-order peak of a model")
    p.add_argument("model", help="an .onnx file")
    add_dim_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("train-graph", help="build the training step (forward, loss, backward, update) as ONNX")
    p.add_argument("model", help="an .onnx file (a forward/inference graph)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write the training step")
    add_dim_option(p)
    p.add_argument("--loss", choices=["cross_entropy", "mse", "output"], default="cross_entropy",
                   help="cross_entropy against int64 'labels', mse against 'targets', or the model's "
                        "scalar output (default: cross_entropy)")
    p.add_argument("--optimizer", choices=["none", "sgd", "momentum", "adam"], default="none",
                   help="none: gradients are outputs; else the update is part of the step (default: none)")
    p.add_argument("--lr", type=float, default=0.01, metavar="F", help="learning rate (default: 0.01)")
    p.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="do not train parameters matching this fnmatch pattern (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_train_graph)
    return parser


def add_dim_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", action="append", metavar="NAME=VALUE", default=[],
                   help="bind a symbolic dimension (repeatable)")


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


def cmd_train_graph(args) -> int:
    from memsched import frontend
    from memsched.onnx_utils import save_model_atomic
    from memsched.views import print_train_graph
    from passes.autodiff import build_training_step, describe

    graph = frontend.load(args.model, frontend.parse_dims(args.dim))
    train = build_training_step(graph, loss=args.loss, optimizer=args.optimizer, lr=args.lr, freeze=args.freeze)
    save_model_atomic(train.to_onnx(), args.output)
    summary = {"output": str(args.output), **describe(train)}
    if args.json:
        print_json(summary)
    else:
        print_train_graph(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
