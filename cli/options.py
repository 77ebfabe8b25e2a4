"""The command line's grammar: the parser of every command (each command's module adds its own
options) and the option helpers and checks they share (argparse)."""
from __future__ import annotations

import argparse
import math
import re

from memsched.errors import UserError
from memsched.hardware import PLANNING_PROFILE

# the training step's losses (passes.training.loss.LOSSES, named here so parsing imports no pass)
LOSSES = ["cross_entropy", "mse", "bce_with_logits", "output"]
# ... and optimizers (passes.training.optimizer.OPTIMIZERS)
OPTIMIZERS = ["none", "sgd", "momentum", "adam", "adamw"]


class Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (an unknown option, a missing argument, a value
    of the wrong kind) are UserErrors: one line and exit code 1, as every other bad input,
    instead of argparse's usage block and exit 2. Subcommands' parsers are of this class too
    (argparse makes them of their parent's)."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """Every command's grammar, each added by its module in memsched.cli.commands (imported
    here, when the parser is built: a module's library imports wait for its handler)."""
    import importlib

    from memsched.cli.commands import NAMES

    parser = Parser(prog="memsched", description="Plan how a training step uses GPU memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in NAMES:
        importlib.import_module(f"memsched.cli.commands.{name}").register(sub)
    return parser


def add_json_option(p: argparse.ArgumentParser, what: str = "print one JSON object") -> None:
    """`--json`: the command prints its answer as JSON (memsched.cli.render) instead of tables."""
    p.add_argument("--json", action="store_true", help=what)


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


def positive_int(what: str, least: int = 1):
    """argparse type for a count or size named `what`: an integer of at least `least` (1; 0
    for a seed; anything else is one line and exit 1: argparse's usage error, or a UserError
    naming `what`)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
        if value < least:
            raise UserError(f"{what} '{text}' must be a whole number of at least {least}")
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




def add_hardware_option(p: argparse.ArgumentParser, default: str | None = PLANNING_PROFILE,
                        what: str = "the profile to plan for", shown: str | None = None) -> None:
    """`--hardware`: a preset name or a TOML/JSON profile file, in every command. Commands that
    plan or simulate a model default to memsched.hardware.PLANNING_PROFILE; commands that
    read a plan default (None) to the plan's (`shown` says how where that differs)."""
    shown = shown or (default if default is not None else "the plan's")
    p.add_argument("--hardware", default=default, metavar="PROFILE",
                   help=f"{what}: a preset name or a TOML/JSON profile file (default: {shown})")


def add_threads_option(p: argparse.ArgumentParser, default: int = 0, why: str = "") -> None:
    """`--threads`: ONNX Runtime's intra-op threads, one meaning in every command: 0 every
    core (ONNX Runtime's default), 1 each kernel on the calling thread (its time is CPU time,
    immune to other load). Every command defaults to 0 but the ones that time kernels."""
    p.add_argument("--threads", type=int, default=default, metavar="N",
                   help=f"ONNX Runtime intra-op threads: 0 every core, 1 one thread (default {default}{why})")


def add_dim_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", action="append", metavar="NAME=VALUE", default=[],
                   help="bind a symbolic dimension (repeatable)")


TRAINING_DEFAULTS = {"loss": "cross_entropy", "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0}


def add_training_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--train", action="store_true", help="plan the training step (forward, loss, backward, update)")
    p.add_argument("--loss", default=TRAINING_DEFAULTS["loss"], choices=LOSSES)
    p.add_argument("--optimizer", default=TRAINING_DEFAULTS["optimizer"], choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=TRAINING_DEFAULTS["lr"],
                   help="learning rate (default 0.01; a trainer may change it)")
    p.add_argument("--momentum", type=float, default=TRAINING_DEFAULTS["momentum"],
                   help="with --optimizer momentum (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=TRAINING_DEFAULTS["weight_decay"],
                   help="SGD/Adam: L2 penalty in the gradient; AdamW: decoupled decay (default 0: no decay ops)")
    p.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                   help="parameters matching this fnmatch pattern are not trained (repeatable)")


def check_training_options(args: argparse.Namespace) -> None:
    """A training option set without --train is a UserError: the forward plan would ignore it."""
    if args.train:
        return
    given = [name for name, default in TRAINING_DEFAULTS.items() if getattr(args, name) != default]
    given += ["freeze"] if args.freeze else []
    if given:
        raise UserError(f"--{given[0].replace('_', '-')} is an option of the training step; add --train "
                        f"(without it the forward pass alone is planned)")
