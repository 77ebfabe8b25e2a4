"""Learning-rate schedules: functions from the step number (0 for the first) to the rate.

They follow torch.optim.lr_scheduler's formulas, stepped once per optimizer step:

- `constant`: the base rate;
- `step:EVERY:GAMMA`: the base rate times GAMMA every EVERY steps (StepLR);
- `cosine` or `cosine:MIN`: from the base rate down to MIN (default 0) over the run's steps
  (CosineAnnealingLR with T_max the run's steps);
- `warmup:N,REST`: linear from base/N up to the base over the first N steps (LinearLR from
  1/N), then REST (any of the above) on the steps after them.

`parse` turns the command line's text into such a function; the Python API takes any callable.
"""
from __future__ import annotations

import math
from typing import Callable

from .errors import UserError

Schedule = Callable[[int], float]


def constant(base: float) -> Schedule:
    return lambda step: base


def step_decay(base: float, every: int, gamma: float) -> Schedule:
    return lambda step: base * gamma ** (step // every)


def cosine(base: float, total: int, minimum: float = 0.0) -> Schedule:
    total = max(total, 1)
    return lambda step: minimum + (base - minimum) * (1 + math.cos(math.pi * min(step, total) / total)) / 2


def warmup(base: float, steps: int, then: Schedule) -> Schedule:
    return lambda step: base * (step + 1) / steps if step < steps else then(step - steps)


def parse(text: str | None, base: float, total: int) -> Schedule:
    """The schedule `text` names (module doc) for base rate `base` over `total` steps."""
    text = (text or "constant").strip()
    head, _, rest = text.partition(",")
    kind, *args = head.split(":")
    try:
        if kind == "warmup" and len(args) == 1 and rest:
            steps = int(args[0])
            if steps < 1:
                raise ValueError
            return warmup(base, steps, parse(rest, base, max(total - steps, 1)))
        if rest:
            raise ValueError
        if kind == "constant" and not args:
            return constant(base)
        if kind == "step" and len(args) == 2 and int(args[0]) >= 1 and float(args[1]) >= 0:
            return step_decay(base, int(args[0]), float(args[1]))
        if kind == "cosine" and len(args) <= 1:
            minimum = float(args[0]) if args else 0.0
            if not 0 <= minimum <= base:
                raise ValueError
            return cosine(base, total, minimum)
    except ValueError:
        pass
    raise UserError(f"unknown learning-rate schedule '{text}'; use constant, step:EVERY:GAMMA, cosine[:MIN] or "
                    f"warmup:N,<schedule>")
