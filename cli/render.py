"""The one renderer: a command's answer as JSON (`--json`) or as the tables of memsched.views."""
from __future__ import annotations

import json


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


def show_report(result, html_path: str | None, written: dict, as_json: bool) -> int:
    """Write the HTML report if asked, then print the report (JSON or the terminal summary)."""
    from memsched.report import write_html
    from memsched.views import print_compile

    if html_path:
        written["report"] = str(write_html(html_path, result.report, result.baseline_sim.to_dict(),
                                           result.sim.to_dict()))
    report = {**result.report, "written": written}
    if as_json:
        print_json(report)
    else:
        print_compile(report)
    return 0
