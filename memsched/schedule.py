"""Schedules and plans: what runs when, on which stream, and where each buffer lives.

A Schedule is a list of Steps. A Plan bundles a Graph with a Schedule and everything a
planning pass decides (aliases for in-place ops, arena offsets, what starts on the host);
passes are pure functions Plan -> Plan built on `dataclasses.replace`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .ir import Graph


class StepKind(str, Enum):
    """What a schedule step does. A str: it equals, hashes and prints as its value, the form
    plans store it in."""

    COMPUTE = "compute"
    RECOMPUTE = "recompute"
    SWAP_OUT = "swap_out"
    SWAP_IN = "swap_in"
    FREE = "free"

    __str__ = str.__str__
    __format__ = str.__format__


STEP_KINDS = tuple(StepKind)
RUNS = frozenset({StepKind.COMPUTE, StepKind.RECOMPUTE})     # steps that run an op
COPIES = frozenset({StepKind.SWAP_OUT, StepKind.SWAP_IN})    # steps that copy a tensor between tiers
STREAMS = ("compute", "d2h", "h2d")
HOST_TIERS = ("dram", "nvdimm")


@dataclass(frozen=True)
class Step:
    """One event of a schedule. `target` is an op name (compute, recompute) or a tensor name."""

    kind: StepKind
    target: str
    tier: str | None = None
    stream: str = "compute"

    def __str__(self) -> str:
        tier = f"@{self.tier}" if self.tier else ""
        return f"{self.kind}({self.target}{tier})"


def compute(op: str) -> Step:
    return Step(StepKind.COMPUTE, op)


def recompute(op: str) -> Step:
    return Step(StepKind.RECOMPUTE, op)


def swap_out(tensor: str, tier: str = "dram") -> Step:
    return Step(StepKind.SWAP_OUT, tensor, tier, "d2h")


def swap_in(tensor: str, tier: str = "dram") -> Step:
    return Step(StepKind.SWAP_IN, tensor, tier, "h2d")


def free(tensor: str) -> Step:
    return Step(StepKind.FREE, tensor)


Schedule = list[Step]


def default_schedule(graph: Graph) -> Schedule:
    """The graph's stored op order, each tensor freed after its last use (implicitly)."""
    return [compute(op.name) for op in graph.ops]


def order_schedule(order: list[str]) -> Schedule:
    """A schedule that computes the given op names in order."""
    return [compute(name) for name in order]


@dataclass(frozen=True)
class Plan:
    """A Graph plus every decision about its memory.

    aliases:   output tensor -> input tensor whose storage it takes (in-place ops).
    offsets:   (tensor, residency index) -> byte offset in the arena (see memory.Residency).
    on_host:   static tensors that start the step on the host and must be swapped in.
    budget:    device bytes the plan must stay within, or None.
    notes:     what each pass did, for the report (pass name -> free-form JSON-able dict).
    """

    graph: Graph
    schedule: Schedule
    aliases: dict[str, str] = field(default_factory=dict)
    offsets: dict[tuple[str, int], int] | None = None
    on_host: frozenset[str] = frozenset()
    budget: int | None = None
    hardware: Any = None
    notes: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def initial(cls, graph: Graph, budget: int | None = None, hardware: Any = None) -> "Plan":
        return cls(graph, default_schedule(graph), budget=budget, hardware=hardware)
