"""The planning passes of one compile, in one table, and what every pass reads.

Each pass is `f(plan, seconds, context) -> plan`: `seconds` is the effort it is given (a
fixed share of the time limit, so the same input gives the same plan) and `context` holds
what the command gives every pass alike -- the measured cost table, the deadline, whether
the step is data-parallel, the rewritten steps reuse may pick. A `PassRunner` applies a pass by
name, times it and judges its result with the memory model, as the pipeline and the fit
search do for every attempt.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

from memsched.cost import CostTable
from memsched.deadline import Deadline
from memsched.ir import Graph
from memsched.memory import validate
from memsched.schedule import Plan

DRAINED = "recompute-drained"        # the recompute pass on drained orders (passes.order.drain)


@dataclass(frozen=True)
class PassContext:
    """What every pass of a command reads besides its plan and effort.

    costs:         the measured cost table recompute and swap price by (as fit and the
                   report do), or None for the roofline on the plan's hardware.
    deadline:      the command's; a pass stops early where it cuts.
    data_parallel: the step all-reduces every gradient, so reuse fuses no update into its dW
                   Gemm, and reuse and order leave the updates last (passes.reuse.updates_last).
    variants:      rewritten training steps reuse may pick instead (passes.rewrites.concat_split).
    """

    costs: CostTable | None = None
    deadline: Deadline | None = None
    data_parallel: bool = False
    variants: dict[str, Graph] = field(default_factory=dict)


def _last(plan: Plan, context: PassContext) -> Plan:
    from memsched.passes.reuse import updates_last
    return updates_last(plan) if context.data_parallel else plan


def _reuse(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.reuse import reuse_pass
    return _last(reuse_pass(plan, not context.data_parallel, context.variants), context)


def _order(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.order import order_pass
    return _last(order_pass(plan, seconds, deadline=context.deadline), context)


def _recompute(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.recompute.planner import recompute_pass
    return recompute_pass(plan, seconds, deadline=context.deadline, costs=context.costs)


def _recompute_drained(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.recompute.planner import recompute_pass
    return recompute_pass(plan, seconds, drained=True, deadline=context.deadline, costs=context.costs)


def _swap(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.swap.planner import swap_pass
    return swap_pass(plan, seconds, deadline=context.deadline, costs=context.costs)


def _placement(plan: Plan, seconds: float, context: PassContext) -> Plan:
    from memsched.passes.placement import place_pass
    return place_pass(plan, seconds, context.deadline)


# pass name -> the pass; each module is imported on first use, so loading the pipeline stays cheap
PASSES: dict[str, Callable[[Plan, float, PassContext], Plan]] = {
    "reuse": _reuse, "order": _order, "recompute": _recompute, DRAINED: _recompute_drained, "swap": _swap,
    "placement": _placement}


def judged_peak(plan: Plan) -> int:
    """The memory model's peak of `plan`, whatever its budget (every pass's result is judged)."""
    return validate(dataclasses.replace(plan, budget=None)).peak_bytes


@dataclass
class PassRunner:
    """Applies the passes of `table` by name with one `context`, and judges each result.
    `timings` gathers the seconds each pass took (the report's `pass_seconds`)."""

    context: PassContext = field(default_factory=PassContext)
    table: dict[str, Callable[[Plan, float, PassContext], Plan]] = field(default_factory=lambda: dict(PASSES))
    judge: Callable[[Plan], int] = judged_peak
    timings: dict[str, float] = field(default_factory=dict)

    def apply(self, name: str, plan: Plan, seconds: float) -> tuple[Plan, int]:
        """Pass `name` on `plan` with `seconds` of effort: (its plan, that plan's judged peak)."""
        started = time.perf_counter()
        try:
            planned = self.table[name](plan, seconds, self.context)
            return planned, self.judge(planned)
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - started

    def with_variants(self, variants: dict[str, Graph]) -> "PassRunner":
        """This runner for another form of the step: its own rewritten variants, the same
        table, context otherwise and timings."""
        return dataclasses.replace(self, context=dataclasses.replace(self.context, variants=variants))
