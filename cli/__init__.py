"""memsched's command line: parses arguments, calls the library, prints. No logic of its own.

`main` is the program (`memsched`, `python -m memsched`); `options` is its grammar, `commands`
what each command does and prints."""
from memsched.cli.main import main

__all__ = ["main"]
