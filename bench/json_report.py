"""How a bench ends: its report as indented JSON on standard output, and the same text in a
file when one is asked for (written atomically, so a file there is always a whole report)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memsched.onnx_utils import write_text_atomic  # noqa: E402


def emit(report: dict, path: str | None = None, echo: bool = True) -> int:
    """Print `report` (unless not `echo`), write it to `path` if given; the bench's exit status (0)."""
    text = json.dumps(report, indent=2)
    if echo:
        print(text)
    if path:
        write_text_atomic(path, text + "\n")
    return 0
