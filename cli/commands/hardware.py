"""`memsched hardware`: the hardware profiles (list, show) and calibrating this machine."""
from __future__ import annotations

import json

from memsched.cli.options import add_json_option, add_threads_option, positive_int
from memsched.cli.render import print_json

from memsched.outputs import check_outputs


def register(sub) -> None:
    hw = sub.add_parser("hardware", help="hardware profiles: list, show, calibrate this machine")
    hw_sub = hw.add_subparsers(dest="hardware_command", required=True, metavar="ACTION")
    p = hw_sub.add_parser("list", help="the bundled profiles")
    add_json_option(p)
    p.set_defaults(handler=list_profiles)
    p = hw_sub.add_parser("show", help="one profile, by preset name or TOML/JSON file")
    p.add_argument("profile", metavar="NAME|FILE")
    add_json_option(p, what="print the profile as JSON (a valid profile file)")
    p.set_defaults(handler=show)
    p = hw_sub.add_parser("calibrate", help="fit this machine's per-op-class costs with ONNX Runtime timings")
    p.add_argument("-o", "--output", required=True, help="profile file to write (.json)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=20, help="timed runs per op (median)")
    add_threads_option(p, default=1, why=": timed in CPU time, immune to other load")
    p.add_argument("--references", default="all", metavar="MODELS",
                   help="bundled models whose training steps (small sizes) the class costs are fitted to, "
                        "with the microbenchmarks ('all': every bundled model; '' for none)")
    add_json_option(p)
    p.set_defaults(handler=calibrate)


def list_profiles(args) -> int:
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


def show(args) -> int:
    from memsched import hardware
    from memsched.views import print_hardware

    profile = hardware.load(args.profile).to_dict()
    if args.json:
        print_json(profile)
    else:
        print_hardware(profile)
    return 0


def calibrate(args) -> int:
    from memsched.passes.calibration import DEFAULT_REFERENCES, reference_graphs

    from memsched.measure import calibrate
    from memsched.onnx_utils import write_text_atomic
    from memsched.views import print_hardware

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
