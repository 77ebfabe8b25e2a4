"""The program: parses the command line, runs the command's handler, and turns every way out
(an error, Ctrl-C, SIGTERM, a bug) into one line and an exit code."""
from __future__ import annotations

import os
import signal
import sys

from memsched.cli.options import attach_negative_values, build_parser

from memsched.errors import MemschedError, printable
from memsched.outputs import Terminated, install_sigterm_handler


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    previous = install_sigterm_handler()       # temporaries are removed on the way out, as for Ctrl-C
    try:
        given = list(argv) if argv is not None else sys.argv[1:]
        args = parser.parse_args(attach_negative_values(given))   # a `type=` may raise UserError (a bad value)
        args.argv = given    # a launcher starts ranks with them
        return args.handler(args)
    except MemschedError as exc:
        print(f"memsched: error: {printable(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("memsched: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("memsched: terminated", file=sys.stderr)
        return 143
    except MemoryError:         # a model or data file that claims more than this machine holds
        print("memsched: error: out of memory: the model or data is larger than this machine's memory "
              "allows (smaller sizes, or a machine with more memory)", file=sys.stderr)
        return 1
    except OSError as exc:      # a full disk, a file it may not read or write: the system's reason
        print(f"memsched: error: {printable(os_error_line(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - a bug, but the user still gets one line
        if os.environ.get("MEMSCHED_DEBUG"):
            raise
        print(f"memsched: internal error: {type(exc).__name__}: {printable(exc)} "
              f"(set MEMSCHED_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
    finally:        # a caller in the same process (a test, a notebook) gets its own handler back
        signal.signal(signal.SIGTERM, previous)
        if argv is None:      # the program itself: a Ctrl-C from here on finds the work over, and
            signal.signal(signal.SIGINT, signal.SIG_IGN)    # must not kill the process (exit -2) on its way out


def os_error_line(exc: OSError) -> str:
    """'cannot open PATH: Permission denied': the file and the system's reason, as other tools
    say it (a failed write is the writers' UserError, its temporary removed)."""
    reason = exc.strerror or str(exc)
    return f"cannot open {exc.filename}: {reason}" if exc.filename else reason
