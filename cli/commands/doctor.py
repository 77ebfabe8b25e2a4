"""`memsched doctor`: whether plans can run on CUDA here, and the fix."""
from __future__ import annotations

from memsched.cli.options import add_json_option
from memsched.cli.render import print_json


def register(sub) -> None:
    p = sub.add_parser("doctor", help="can plans run on CUDA here: providers, GPU, CUDA libraries, and the fix")
    add_json_option(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from memsched.doctor import diagnose
    from memsched.views import print_doctor

    report = diagnose()
    if args.json:
        print_json(report)
    else:
        print_doctor(report)
    return 0
