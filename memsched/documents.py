"""The one reader of the JSON and TOML files a user gives memsched: hardware profiles, cost
tables, remat graphs. A file that is not a regular file (a FIFO blocks, /dev/zero never ends),
too large, unreadable, not text, not JSON/TOML, nested past what a parser can walk, or holding
an integer past Python's digit limit is one UserError naming the file: never a hang, a
MemoryError or a RecursionError."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Callable

from .errors import UserError

MAX_DOCUMENT_BYTES = 1 << 30     # a remat graph of 10^6 nodes is about 100 MB


def read_document(path: str | Path, what: str, error: Callable[[str], Exception] = UserError) -> Any:
    """The parsed JSON (TOML for a `.toml` suffix) of `path`; `error(message)` for anything else,
    its message naming `path` and saying it is not a readable `what`."""
    path = Path(path)
    if not path.exists():
        raise error(f"no such {what}: {path}")
    if not path.is_file():
        raise error(f"{path} is not a regular file (a device, FIFO, socket or folder); give a {what} file")
    size = path.stat().st_size
    if size > MAX_DOCUMENT_BYTES:
        raise error(f"{path} holds {size:,} bytes; a {what} is at most {MAX_DOCUMENT_BYTES:,}")
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path} is not a readable {what}: not UTF-8 text ({exc.reason})") from None
    return parse_text(text, f"{path} is not a readable {what}", toml=path.suffix.lower() == ".toml", error=error)


def parse_text(text: str, refusal: str, toml: bool = False, error: Callable[[str], Exception] = UserError) -> Any:
    """`text` parsed as JSON (TOML with `toml`); `error("<refusal>: <why>")` where it is not:
    not JSON/TOML, nested past what the parser can walk, or holding an integer past Python's
    digit limit. The one parse of every document memsched reads, a plan's too."""
    try:
        return tomllib.loads(text) if toml else json.loads(text)
    except RecursionError:
        raise error(f"{refusal}: nested too deeply") from None
    except ValueError as exc:        # JSON's and TOML's decode errors, an integer past the digit limit
        raise error(f"{refusal}: {exc}") from None
