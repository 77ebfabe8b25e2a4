"""`memsched models`: the bundled model zoo (list, export) and the digits data set."""
from __future__ import annotations

from memsched.cli.options import add_json_option, positive_int
from memsched.cli.render import print_json

from memsched.onnx_utils import save_model_atomic
from memsched.outputs import check_outputs


def register(sub) -> None:
    p = sub.add_parser("models", help="the bundled model zoo: list it, export a model as ONNX")
    models_sub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = models_sub.add_parser("list", help="every bundled model with its parameters at default size")
    add_json_option(p)
    p.set_defaults(handler=list_models)
    p = models_sub.add_parser("export", help="build a bundled model and write it as ONNX")
    p.add_argument("name", help="a model name from `memsched models list`")
    p.add_argument("-o", "--output", required=True, metavar="OUT.onnx", help="where to write it")
    for flag, meta, what in (("--batch", "N", "batch size"), ("--size", "S", "input resolution"),
                             ("--seq", "L", "sequence length"), ("--classes", "K", "number of classes"),
                             ("--layers", "N", "transformer layers")):
        p.add_argument(flag, type=positive_int(flag), metavar=meta, help=f"{what} (default: the model's)")
    p.add_argument("--dtype", choices=("float32", "float16"), default="float32", help="weight and activation type")
    p.set_defaults(handler=export)

    p = models_sub.add_parser("digits", help="write scikit-learn's digits as train.npz and test.npz (for train)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the folder to write them into")
    p.add_argument("--seed", type=positive_int("--seed", least=0), default=0,
                   help="seed of the train/test split (default 0)")
    p.set_defaults(handler=digits)


def list_models(args) -> int:
    from memsched import models
    from memsched.views import print_models

    entries = models.catalog()
    if args.json:
        print_json({"models": entries})
    else:
        print_models(entries)
    return 0


def export(args) -> int:
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


def digits(args) -> int:
    from memsched.models.digits import TRAIN_SAMPLES, write

    train, test = write(args.output, args.seed)
    print(f"wrote {train} ({TRAIN_SAMPLES} samples) and {test}: 8x8 images as 'input', their digits as 'labels'")
    return 0
