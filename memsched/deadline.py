"""One wall-clock deadline for a whole command, handed down to every pass and solver.

A command such as `compile` has one `--time-limit`: every pass, candidate and solver call
shares it instead of each getting seconds of its own that add up. Inside, the passes keep
their deterministic limits (CP-SAT's deterministic time, fixed seeds, counted loops), so the
same input gives the same plan; the deadline only cuts a search short, and says so (`cut`)
so a result can be reported as possibly different from run to run.

`stop()` ends the search early (Ctrl-C): `expired` turns true at once, and the CP-SAT
searches running at that moment are told to stop through the callbacks they register with
`stopping`.
"""
from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator


class Deadline:
    """A wall-clock end (`time.perf_counter()` seconds) and whether anything was cut by it."""

    def __init__(self, seconds: float | None = None, already: float = 0.0):
        self.started = time.perf_counter() - already    # `already`: seconds the command ran before
        self.end = math.inf if seconds is None else self.started + max(0.0, float(seconds))
        self.cut = False          # a search ended early because of this deadline
        self.stopped = False      # stop() was called (Ctrl-C)
        self.planned = False      # a plan holding the budget is kept: past the deadline, nothing is
                                  # owed (until then counted heuristics keep their floors, so an answer comes)
        self._stops: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def left(self) -> float:
        """Seconds left (0 once stopped; inf for no deadline)."""
        return 0.0 if self.stopped else max(0.0, self.end - time.perf_counter())

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def expired(self) -> bool:
        """Whether the time is up (a plain reading: nothing is marked)."""
        return self.stopped or time.perf_counter() >= self.end

    def cuts(self) -> bool:
        """Whether the time is up, for a caller that stops its work if so: the deadline is then
        marked as having cut something (`cut`), so the result is reported as possibly different
        from run to run."""
        if self.expired:
            self.cut = True
            return True
        return False

    def cap(self, seconds: float) -> float:
        """`seconds`, or what is left of the deadline where that is less (marked as a cut)."""
        left = self.left()
        if left < seconds:
            self.cut = True
            return left
        return float(seconds)

    def affords(self, seconds: float) -> bool:
        """Whether work that takes `seconds` ends before the deadline; where it would not, the
        deadline is marked as having cut (the work is not started)."""
        if self.left() < seconds:
            self.cut = True
            return False
        return True

    @contextmanager
    def reserving(self, seconds: float) -> Iterator[None]:
        """Inside, the deadline ends `seconds` earlier: the time kept for the work that follows
        (the report's simulations, writing the plan)."""
        self.end -= seconds
        try:
            yield
        finally:
            self.end += seconds

    def stop(self) -> None:
        """End the search now: `expired` is true from here on and running solvers are stopped."""
        with self._lock:
            self.stopped = True
            stops = list(self._stops)
        for stop in stops:
            stop()

    @contextmanager
    def stopping(self, stop: Callable[[], None]) -> Iterator[None]:
        """While inside, `stop()` also calls `stop` (e.g. a CP-SAT solver's StopSearch)."""
        with self._lock:
            self._stops.append(stop)
            already = self.stopped
        if already:
            stop()
        try:
            yield
        finally:
            with self._lock:
                self._stops.remove(stop)


def process_age() -> float:
    """Seconds since this process started (Linux: /proc/self/stat against CLOCK_BOOTTIME;
    0 where that cannot be read): a command's time limit counts its interpreter's start-up
    and imports too, as a user timing the command does."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")       # field 22: starttime, in ticks
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def for_command(seconds: float | None) -> Deadline:
    """The deadline of a whole command run from the shell: `seconds` from the process's start."""
    return Deadline(seconds, already=process_age())


def unlimited() -> Deadline:
    """A deadline that never expires (library calls without a time limit)."""
    return Deadline(None)


class Work:
    """A deterministic budget for a heuristic loop: `seconds` as the loop's own cost model
    prices its steps (not as the clock measures them), so the same budget takes the same steps
    on any machine and under any load; the command's `deadline`, where given, still ends it
    early (and is marked as having cut it)."""

    def __init__(self, seconds: float, deadline: Deadline | None = None):
        self.budget = max(0.0, float(seconds))
        self.spent = 0.0
        self.deadline = deadline

    @property
    def left(self) -> float:
        """The budget less what is spent: infinite for an unbounded tally, whose `spent` is
        still the sum of its steps' prices."""
        return self.budget - self.spent

    def ok(self) -> bool:
        """Whether another step may run: budget left and the deadline not passed."""
        return self.left > 0 and not (self.deadline is not None and self.deadline.cuts())

    def spend(self, seconds: float) -> None:
        self.spent += seconds
