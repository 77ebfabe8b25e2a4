"""memsched's command line: parses arguments, calls the library, prints. No logic of its own."""
from __future__ import annotations

import argparse
import json
import os
import sys

from memsched.errors import MemschedError
from memsched.onnx_utils import save_model_atomic


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
        p.add_argument(flag, type=int, metavar=meta, help=f"{what} (default: the model's)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="weight and activation type")
    p.set_defaults(handler=cmd_models_export)
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

    extra = {} if args.layers is None else {"layers": args.layers}
    try:
        model = models.build(args.name, batch=args.batch, size=args.size, seq=args.seq,
                             classes=args.classes, dtype=args.dtype, **extra)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    try:
        path = save_model_atomic(model, args.output)
    except OSError as exc:
        raise UserError(f"cannot write {args.output}: {exc.strerror or exc}") from exc
    print(f"wrote {path}: {args.name}, {models.count_parameters(model):,} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
