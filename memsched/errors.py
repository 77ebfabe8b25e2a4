"""Errors that reach the user as one line and an exit code (README, "Exit codes": 1 user error, 3 budget)."""
from __future__ import annotations


class MemschedError(Exception):
    """Base of every error the CLI prints as one line; `exit_code` is what the process returns."""

    exit_code = 1


class UserError(MemschedError):
    """Bad input: a missing or broken file, a bad option, an unsupported op."""


class ScheduleError(MemschedError):
    """A schedule or plan that breaks the memory model (a tensor used while not resident, ...)."""


class BudgetError(MemschedError):
    """The budget cannot be met; carries the smallest budget that was reached."""

    exit_code = 3

    def __init__(self, message: str, smallest_feasible_bytes: int | None = None):
        super().__init__(message)
        self.smallest_feasible_bytes = smallest_feasible_bytes


def first_line(exc: BaseException) -> str:
    """An exception's first line (a library's message often runs on with frames or dumps); a
    line that ends in a colon takes the next one too, so no sentence stops mid-way."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not text:
        return type(exc).__name__
    return f"{text[0]} {text[1]}" if text[0].endswith(":") and len(text) > 1 else text[0]


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (newline, carriage return, escape,
    NUL, other control characters) written as its Python escape (`\\n`, `\\x1b`): names from a
    model reach error lines and tables, and one such name must not split a line, forge one, or
    clear the screen."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
