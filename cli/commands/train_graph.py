"""`memsched train-graph`: the training step (forward, loss, backward, update) as ONNX."""
from __future__ import annotations

from memsched.cli.options import LOSSES, OPTIMIZERS, add_dim_option, add_json_option
from memsched.cli.render import print_json

from memsched.onnx_utils import save_model_atomic
from memsched.outputs import check_outputs


def register(sub) -> None:
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
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.passes.training import build_training_step, describe
    from memsched.passes.training.gan import build_gan_step

    from memsched import frontend
    from memsched.errors import UserError
    from memsched.views import print_train_graph

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
