"""Output files: checked before any work, written through recognisable temporaries, never destructive.

Every command names its output paths (`-o`, `--report`, `--html`, `--plot`) and its input
paths to `check_outputs` before it starts work, so a bad output costs nothing: an output
that is an input (it would replace the model being read), that is a directory, a device, a
FIFO or a socket (a rename would replace the node with a regular file), whose directory
cannot be created or written, or that two options name at once is refused with one line.

The atomic writers (`memsched.onnx_utils`) write to a temporary beside the output named
`.<output name>.<...>.memsched-tmp-<pid>-<random>.tmp` and rename it into place. A process
killed with SIGKILL leaves that temporary behind; the next write to the same output removes
the ones whose writer is dead or that are older than `STALE_AFTER_S`. SIGTERM is turned into
`Terminated` (see `install_sigterm_handler`), so the writers' cleanup runs as for Ctrl-C.
Written files get the mode the umask gives a new file (0666 & ~umask), not mkstemp's 0600.
"""
from __future__ import annotations

import os
import re
import signal
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from .errors import UserError

TEMP_TAG = ".memsched-tmp-"
STALE_AFTER_S = 3600.0      # a temporary this old is stale even if its pid is alive (pids are reused)
_TEMP_RE = re.compile(re.escape(TEMP_TAG) + r"(?P<pid>\d+)-[A-Za-z0-9_]+\.tmp$")

PathLike = str | os.PathLike


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it
    and every `except BaseException`/`finally` cleanup on the way out runs."""


def install_sigterm_handler():
    """Make SIGTERM raise `Terminated` in the main thread, so temporaries are removed on the way
    out; returns the handler it replaced (for `signal.signal` to put back)."""
    def handler(signum, frame):
        raise Terminated()
    return signal.signal(signal.SIGTERM, handler)


def check_outputs(outputs: Mapping[str, PathLike | None], inputs: Iterable[PathLike | None] = ()) -> None:
    """Refuse, before any work, output paths that cannot be written or whose writing would destroy something.

    `outputs` maps the option that names each output (e.g. '-o', '--report') to its path; None
    entries (options not given) are skipped. `inputs` are the paths the command reads. Raises
    UserError naming the option and the path for the first bad one. An ONNX input's external
    data files are inputs too: writing over one would leave the model without its weights."""
    given = [(option, Path(path)) for option, path in outputs.items() if path is not None and str(path) != ""]
    direct = [Path(p) for p in inputs if p is not None and str(p) != ""]
    sources = [(source, f"the input {source}") for source in direct]
    sources += [(data, f"the external data of the input {source}") for source in direct
                if any(_may_be_data_of(path, source) for _, path in given)
                for data in _external_data_files(source)]
    seen: dict[str, str] = {}
    for option, path in given:
        check_writable(path, option)
        for source, what in sources:
            if _same_file(path, source):
                raise UserError(f"{option} {path} is {what}; writing it would replace the input, "
                                f"so give another output path")
        key = os.path.abspath(path)
        if key in seen:
            raise UserError(f"{seen[key]} and {option} both name {path}; give each output its own path")
        seen[key] = option


def _may_be_data_of(path: Path, source: Path) -> bool:
    """Whether output `path` could be an external-data file of model `source`: it lies in the
    model's folder tree (where memsched reads data files from), or it is an existing file with
    another name (a hard link); an output that does not exist yet is no input's data file. Only
    then is the model parsed for its data files, which for a large model costs seconds."""
    try:
        if os.stat(path).st_nlink > 1:
            return True
    except OSError:
        return False
    folder = os.path.realpath(source.parent)
    where = os.path.realpath(path.parent)
    return where == folder or where.startswith(folder + os.sep)


def _external_data_files(source: Path) -> list[Path]:
    """The external-data files an ONNX model at `source` names (none for another file, or one
    that does not parse: the command that reads it says why)."""
    if source.suffix.lower() != ".onnx" or not source.is_file():
        return []
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    from . import model_file

    try:
        model = model_file.read(source)        # as the front end reads it: a large model's weights left in place
    except Exception:  # noqa: BLE001 - not a model: its reader reports it
        return []
    locations = {entry.value for tensor in _get_all_tensors(model) if tensor.data_location == onnx.TensorProto.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    locations.discard(source.name)             # weights read in place: the input itself, checked as such
    return [source.parent / location for location in sorted(locations)]


def check_writable(path: PathLike, option: str = "output") -> None:
    """`path` is absent or a regular file, and its directory exists writable or can be created."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UserError(f"cannot write {option} {path}: {exc.strerror or exc}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UserError(f"{option} {path} is a directory; give a file path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{option} {path} is not a regular file (a device, FIFO or socket); "
                        f"memsched writes a new file in its place, so give a file path")
    folder = path.parent
    while not folder.exists():      # the writers create missing folders
        if folder.parent == folder:
            break
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"cannot write {option} {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {option} {path}: no permission to write in {folder}")


def temp_path(path: PathLike, name: str | None = None) -> str:
    """Create an empty temporary beside `path` (for `name`, default the path's own name) and return it.

    Stale temporaries of earlier writes to the same output are removed first."""
    path = Path(path)
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name or path.name}{TEMP_TAG}{os.getpid()}-", suffix=".tmp",
                               dir=path.parent)
    os.close(fd)
    return tmp


def remove_stale_temporaries(path: PathLike, now: float | None = None) -> list[Path]:
    """Remove temporaries left beside `path` by writes that died: their pid is gone or they are older
    than STALE_AFTER_S. Returns what was removed."""
    path = Path(path)
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    prefix = f".{path.name}"
    for entry in entries:
        match = _TEMP_RE.search(entry.name)
        if not entry.name.startswith(prefix) or match is None:
            continue
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
            if not entry.is_file(follow_symlinks=False):
                continue
            if _pid_alive(int(match["pid"])) and age < STALE_AFTER_S:
                continue
            os.unlink(entry.path)
            removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


def finish_mode(tmp: PathLike) -> None:
    """Give a temporary the mode a newly created file gets under the current umask (mkstemp makes 0600)."""
    os.chmod(tmp, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def unlink_quietly(*paths: PathLike) -> None:
    """Remove each path that exists; the cleanup of a failed write must not raise over the real error."""
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:      # alive, owned by someone else
        return True
    return True


def _same_file(a: Path, b: Path) -> bool:
    """Both exist and are one file (hard links and symlinks included); a missing one is no other file."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
