"""The fit search: the fastest placed plan that holds a memory budget, found anytime under
the command's one deadline.

A plan over its budget needs recompute, swap or both. The candidates (`Candidate`):
recompute alone; swap alone (it replays too); recompute down to a relaxed target
(RELAXATION_GRID x the target: replaying what is cheap per byte), then swap the rest, whose
transfers the link can hide; and the same with the recompute pass planning on drained base
orders too (`passes.order.drain`: a big tensor's readers run together, which the swap after
the replays may need -- 3-D U-Net 264^3: +14.9% against +48.1% -- or lose by -- ResNet-50
batch 1004 at 1.75x: +30.9% against +18.6%). The best relaxation depends on the model and
the link, so it is climbed, not fixed.

A candidate planned at a target with an effort (the seconds each of its passes may take) is
an attempt: its judged peak, its predicted step time (the simulator, before placement, whose
offsets can only narrow the waits for swap-outs), and -- where it is faster than the best
placed plan so far -- its arena. Where the arena overshoots the budget (fragmentation), the
candidate is planned again against a lower target, at most FIT_ROUNDS times: lowered by the
overshoot, but by at least MIN_LOWERING of the budget (a plan made a few hundred bytes lower
fragments as the one before it); where a lowered target no longer fits, once more halfway
back.

The search is anytime and monotone: cheap plans first, so that a fitting plan exists early,
then better ones while its effort lasts; the best placed plan is kept throughout.
1. First plans, at `Ledger.quick` seconds per pass: the plan as it is where it fits, else
   recompute alone (where it adds no time, nothing is left to gain), swap alone, the joint
   candidates at RELAXATION_START, then the climb towards the faster neighbour until the
   fastest point has both neighbours tried.
2. Improvement levels 1, 2, 3, ... at `Ledger.level(k)` seconds a pass, doubling from
   IMPROVE_SECONDS: the IMPROVE_COUNT fastest candidates so far planned again with that
   effort (`passes.pipeline` runs the levels over every search of the command).
3. Exploration, after level 1: the same climb on drained orders.
4. Rescue, where no arena held the budget: the plan nearest it (an attempt, or the start
   itself where its live bytes fit) placed again with RESCUE_SECONDS, doubling while the
   ledger affords it.
Every effort is fixed from FLOOR_SECONDS of time limit on (below, all of them shrink with
the limit), and the time limit only sets how much counted effort the `Ledger` lets the
search spend once a plan is kept (WORK_SHARE of it: the efforts are priced as given, the
ledger closes at the first attempt it cannot afford). So the attempts of a shorter limit
are a prefix of those of a longer one, and a longer limit never gives a slower plan. The
passes keep deterministic limits inside, so the same input gives the same plan unless the
wall-clock deadline (a machine far slower than the efforts assume, or a Ctrl-C,
`Deadline.stop`) cut the search, which `cut` reports.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from memsched.errors import BudgetError
from memsched.passes.context import DRAINED, PassRunner
from memsched.schedule import Plan
from memsched.simulate import simulate
from memsched.units import format_bytes

# Re-planning rounds of one candidate against a lower target when its arena overshoots (in
# the first plans, once a plan is kept, FIRST_ROUNDS: a candidate whose arena keeps
# overshooting waits its turn).
FIT_ROUNDS = 3
FIRST_ROUNDS = 2
# The least a target is lowered after an overshoot, as a share of the budget (about 0.2%).
MIN_LOWERING = 1 / 512
# Relaxations of the joint candidates (x the target) and the two the climb starts from
# (predicted on v100-16gb: BERT-base batch 660 best at 1.5x, ResNet-50 batch 975 at 1.75x).
RELAXATION_GRID = (1.25, 1.5, 1.75, 2.0, 2.5, 3.0)
RELAXATION_START = (1.5, 2.0)
# The efforts, in seconds a pass, from FLOOR_SECONDS of time limit on; under it each is scaled
# by time_limit / FLOOR_SECONDS (a short limit buys quick answers, a longer one more levels).
FLOOR_SECONDS = 10.0
ORDER_SECONDS = 1.0         # the order pass before the search (1 s against 6 s: ResNet-18 b32's
                            # start peak 1.3% higher, BERT-base 8x128's the same)
QUICK_SECONDS = 0.4         # the first plans: a long limit still has a first plan within seconds
IMPROVE_SECONDS = 1.0       # improvement level 1; each next level doubles it
IMPROVE_COUNT = 2
MAX_LEVELS = 8              # level 8 plans at 128 s a pass
PLACE_SECONDS = 0.5         # the least effort placing one attempt gets (else its passes' effort)
RESCUE_SECONDS = 2.0        # the first rescue placement; each next one doubles it
# The priced effort the ledger lets the search spend once a plan is kept, as a share of the
# time limit. Efforts are priced as given (a pass that ends early is still charged all of it);
# on the 2-core development machine one took about 1.9x its price in wall time (ResNet-18
# b32's step: the passes past their counted limits, judging, simulating), and a machine
# loaded twice over doubles that: a quarter keeps the command within its limit there.
WORK_SHARE = 0.25
# Without a budget the plan as it is is placed once, with this share of the time limit (at most
# PLACE_SHARE_SECONDS).
PLACE_SHARE = 0.03
PLACE_SHARE_SECONDS = 10.0


@dataclass(frozen=True)
class Candidate:
    """One way to bring a plan within its target: recompute, swap, or recompute to `relax` x
    the target (on drained base orders too where `drained`), then swap."""

    kind: str                  # "recompute", "swap" or "joint"
    relax: float | None = None
    drained: bool = False

    @property
    def name(self) -> str:
        if self.kind != "joint":
            return self.kind
        return f"recompute to {self.relax:g}x{' on drained orders too' if self.drained else ''}, then swap"

    def steps(self, target: int) -> list[tuple[str, int]]:
        """(pass, budget) in turn; a pass runs only while the plan is over its budget."""
        if self.kind != "joint":
            return [(self.kind, target)]
        return [(DRAINED if self.drained else "recompute", int(self.relax * target)), ("swap", target)]


class Ledger:
    """The counted effort of one command's fit searches: the efforts the search gives its
    passes, and how much of them it may spend once a plan is kept (`budget`, WORK_SHARE of the
    time limit). Every pass call is charged the effort it is given, before it runs; the first
    attempt the ledger cannot afford closes it for good, so a longer limit runs the same
    attempts and then more."""

    def __init__(self, time_limit: float):
        self.time_limit = max(0.0, float(time_limit))
        self.scale = min(1.0, self.time_limit / FLOOR_SECONDS)
        self.budget = WORK_SHARE * self.time_limit
        self.spent = 0.0
        self.closed = False

    @property
    def order(self) -> float:
        return ORDER_SECONDS * self.scale

    @property
    def quick(self) -> float:
        return QUICK_SECONDS * self.scale

    def level(self, k: int) -> float:
        """The effort a pass of improvement level `k` (1, 2, ...) gets."""
        return IMPROVE_SECONDS * self.scale * 2 ** (k - 1)

    def rescue(self, k: int) -> float:
        """The effort of the `k`-th (0, 1, ...) rescue placement."""
        return RESCUE_SECONDS * self.scale * 2 ** k

    def place(self, effort: float) -> float:
        """The effort placing an attempt planned at `effort` gets."""
        return max(effort, PLACE_SECONDS * self.scale)

    def charge(self, price: float) -> None:
        """Spend `price` unasked: the work before a first plan, which an answer needs."""
        self.spent += price

    def take(self, price: float) -> bool:
        """Spend `price` where the budget affords it; else close the ledger (for good)."""
        if self.closed or self.spent + price > self.budget:
            self.closed = True
            return False
        self.spent += price
        return True

    def to_dict(self) -> dict:
        return {"budget_s": round(self.budget, 3), "spent_s": round(self.spent, 3), "closed": self.closed}


@dataclass
class Best:
    step_time: float
    plan: Plan
    record: int          # index of its attempt in FitSearch.tried


class FitSearch:
    """The fit search of one start plan (a training step in some form, reordered and reused)
    against `budget` (None: placed as it is). `runner` applies each pass by name and judges
    it (passes.context: its context holds the deadline and the cost table); `time_limit` is the command's,
    which sets the efforts and the `ledger` (shared by every search of the command); `say`
    reports progress. Once any search of the command keeps a plan (`Deadline.planned`), an
    attempt runs only where the ledger affords it and the deadline has not passed."""

    def __init__(self, start: Plan, start_peak: int, budget: int | None, strategies, runner: PassRunner,
                 time_limit: float, say: Callable[[str], None] = lambda message: None, label: str = "",
                 ledger: Ledger | None = None):
        self.start, self.start_peak, self.budget = start, start_peak, budget
        self.strategies, self.runner = tuple(strategies), runner
        self.time_limit, self.deadline, self.costs = time_limit, runner.context.deadline, runner.context.costs
        self.ledger = ledger or Ledger(time_limit)
        self.say, self.label = say, label
        self.tried: list[dict] = []
        self.best: Best | None = None
        self.lowest = start_peak                 # the lowest judged peak any attempt reached
        self.smallest_arena: int | None = None   # the smallest arena over the budget seen
        self.times: dict[Candidate, float] = {}  # each candidate's fastest fitting step time
        self.targets: dict[Candidate, int] = {}  # the target each candidate is planned against
        self.overshot_at: dict[Candidate, int] = {}  # the last target whose plan fit but overshot
        self.first_target = budget               # lowered where the plan as it is overshoots
        self.placed: Plan | None = None          # the last plan placed
        self.last_planned: Plan | None = None    # the last attempt's plan that fit its target
        self.history: list[dict] = []            # each new best: seconds into the command, its step time
        # the smallest arena over the budget whose live bytes fit: (arena, plan, record; -1: the start)
        self.nearest: tuple[int, Plan, int] | None = None
        # the longest wall time one planned and placed round took: once a plan is kept, no
        # round starts that the deadline cannot afford (a 10,193-op GPT-2 step's take 7-14 s)
        self.slowest_round = 0.0
        self.opening = False                     # in phase 1 (first_plans, joint_climb)
        self.climbs = True                       # whether phase 1 goes on to the joint climb

    # ---- the phases ----
    def first_plans(self) -> None:
        """Phase 1: the plan as it is where it fits (or there is no budget), else the
        candidates recompute and swap at the quick effort (`joint_climb` follows)."""
        self.opening = True
        try:
            if (self.budget is None or self.start_peak <= self.budget) and self._place_as_is():
                self.climbs = False
                return
            effort = self.ledger.quick
            if "recompute" in self.strategies and \
                    self.attempt(Candidate("recompute"), effort, FIRST_ROUNDS) is not None and \
                    self.last_planned.notes["recompute"].get("overhead", 1.0) <= 0.0:
                self.climbs = False     # recompute alone adds no time: nothing to swap for
                return
            if "swap" in self.strategies:
                self.attempt(Candidate("swap"), effort, FIRST_ROUNDS)
            self.climbs = {"recompute", "swap"} <= set(self.strategies)
        finally:
            self.opening = False

    def joint_climb(self) -> None:
        """The rest of phase 1: the joint candidates (recompute to a relaxation of the budget,
        then swap) climbed at the quick effort, where the first plans left room for them.
        A command with several searches runs every search's first plans before any climb, and
        climbs the search with the fastest plan first (the ledger may not afford the others')."""
        if not self.climbs:
            return
        self.opening = True
        try:
            self.climb(False, self.ledger.quick)
        finally:
            self.opening = False

    def explore(self) -> None:
        """Phase 3: the joint candidates on drained orders too, where draining changes them and
        the plan needs swap (their climb at the quick effort)."""
        if not self.improvable() or not {"recompute", "swap"} <= set(self.strategies):
            return
        if not self._stopping() and drains_anything(self.start):
            self.climb(True, self.ledger.quick)

    def adds_time(self) -> bool:
        """Whether the kept plan is predicted slower than its start (the step in its order with
        no recompute or swap): where it is not, no other form of the step can beat it."""
        if self.best is None or self.best.record < 0:
            return False
        start = simulate(dataclasses.replace(self.start, budget=None), self.start.hardware, self.costs).step_time
        return self.best.step_time > start

    def improvable(self) -> bool:
        """Whether improvement can change the plan: one is kept and it came from an attempt."""
        return self.best is not None and self.best.record >= 0

    def improve(self, effort: float) -> None:
        """Phase 2, one level: the IMPROVE_COUNT fastest candidates so far, planned again at
        `effort` seconds a pass and placed with as much: one faster than the kept plan whose
        arena overshot the budget gets its lowered target and a placement that packs tighter
        (ResNet-18 b32 at 60%: recompute to 1.25x then swap, +7%, overshot by 0.05% at the
        quick effort, where the kept swap plan is +48%)."""
        ranked = sorted(self.times, key=lambda c: (self.times[c], c.name))[:IMPROVE_COUNT]
        for candidate in ranked:
            if self._stopping():
                return
            self.attempt(candidate, effort)

    def rescue(self) -> None:
        """Phase 4, where no plan was kept: the plan whose arena came nearest the budget (its
        live bytes fit: an attempt, or the start as it is) placed once more with `Ledger.rescue`
        seconds, doubling while the ledger affords it and the arena still misses.
        The attempts' placements are mostly the greedy and its local search; with more time
        CP-SAT packs the arena, often down to its live bytes."""
        if self.nearest is None:
            return
        _, plan, record = self.nearest
        name, step_time = (self.tried[record]["candidate"], self.tried[record]["step_time_s"]) if record >= 0 \
            else ("the plan as it is", 0.0)
        for k in range(MAX_LEVELS):
            seconds = self.ledger.rescue(k)
            if self.best is not None or self.deadline.cuts() or not self.ledger.take(seconds):
                return
            self.say(f"{self.label}placing {name} again ({seconds:.1f} s)")
            arena = self._place(plan, record if record >= 0 else None, seconds)
            if arena <= self.budget:
                self._keep(Best(step_time, self.placed, record))
            else:
                self.smallest_arena = min(self.smallest_arena, arena)

    def climb(self, drained: bool, effort: float) -> None:
        """Hill-climb the joint candidates' step time over the relaxations that lie under the
        start's peak (`climb_relaxations`)."""
        grid = [r for r in RELAXATION_GRID if self.start_peak > int(r * self.first_target)]
        climb_relaxations(lambda relax: None if self._stopping() else
                          self.attempt(Candidate("joint", relax, drained), effort, FIRST_ROUNDS), grid)

    def _stopping(self, price: float = 0.0) -> bool:
        """Whether to stop before work priced `price`: on a stop (Ctrl-C); or, once a plan is
        kept here or by another search of the command, where the deadline has passed or the
        ledger cannot afford it (until then the work is charged unasked, and passes out of
        time still give their heuristic answers: an answer comes). A search's phase 1 goes on
        until it keeps a plan of its own while the deadline affords it, whatever the other
        searches kept, and is not charged once another search keeps one: the micro-batched
        step is planned after the step as given, whose first plans may have spent the ledger,
        and its first plans leave the ledger to the climbs of both."""
        if self.deadline.stopped:
            return True
        if self.best is None and not self.deadline.planned:
            self.ledger.charge(price)
            return False
        if self.best is None and self.opening:      # another search's plan is kept: this one's first still comes
            return self.deadline.cuts() or not self.deadline.affords(self.slowest_round)
        return self.deadline.cuts() or not self.deadline.affords(self.slowest_round) or not self.ledger.take(price)

    # ---- one attempt ----
    def attempt(self, candidate: Candidate, effort: float, rounds: int = FIT_ROUNDS) -> float | None:
        """Plan `candidate` with `effort` seconds per pass; place it where it beats the best
        so far, against lower targets while its arena overshoots (at most `rounds` plans, each
        priced at its passes' effort and its placement's).
        Returns its step time (None where it does not fit its target, or it was not afforded)."""
        fastest = None
        price = len(candidate.steps(0)) * effort + self.ledger.place(effort)
        for _ in range(rounds if self.best is not None else max(rounds, FIT_ROUNDS)):   # all rounds for a first plan
            if self._stopping(price):
                break
            started = time.perf_counter()
            target = self._target(candidate)
            self.say(f"{self.label}{candidate.name} at {format_bytes(target)} ({effort:.1f} s a pass)"
                     f"{self._best_so_far()}")
            planned = self._planned(candidate, target, effort)
            self.slowest_round = max(self.slowest_round, time.perf_counter() - started)
            if planned is None:
                self._lower_failed(candidate, target)
                break
            plan, record = planned
            step_time = self.tried[record]["step_time_s"]
            fastest = step_time if fastest is None else min(fastest, step_time)
            self.times[candidate] = min(self.times.get(candidate, step_time), step_time)
            if self.best is not None and step_time >= self.best.step_time:
                break           # slower than a placed plan: placing it cannot win
            arena = self._place(plan, record, self.ledger.place(effort))
            self.slowest_round = max(self.slowest_round, time.perf_counter() - started)
            if arena <= self.budget:
                self._keep(Best(step_time, self.placed, record))
                break
            if self.nearest is None or arena < self.nearest[0]:
                self.nearest = (arena, plan, record)
            self._overshot(candidate, target, arena)
        return fastest

    def _planned(self, candidate: Candidate, target: int, effort: float) -> tuple[Plan, int] | None:
        """Apply the candidate's passes; record the attempt. (plan, its record) or None."""
        plan, peak = self.start, self.start_peak
        record = {"candidate": candidate.name, "target_bytes": target, "effort_s": round(effort, 3)}
        try:
            for pass_name, budget in candidate.steps(target):
                if peak > budget:
                    plan, peak = self.runner.apply(pass_name, dataclasses.replace(plan, budget=budget), effort)
        except BudgetError as err:
            reached = err.smallest_feasible_bytes
            self.tried.append({**record, "fits": False, "smallest_peak_bytes": reached, "chosen": False})
            self.lowest = min(self.lowest, reached) if reached is not None else self.lowest
            return None
        step_time = simulate(dataclasses.replace(plan, budget=None), self.start.hardware, self.costs).step_time
        self.tried.append({**record, "fits": True, "peak_bytes": peak, "step_time_s": step_time, "chosen": False})
        self.lowest = min(self.lowest, peak)
        self.last_planned = plan
        return plan, len(self.tried) - 1

    def _place(self, plan: Plan, record: int | None, seconds: float) -> int:
        """Place `plan` (kept as self.placed) in `seconds`; its arena, noted in its record."""
        self.placed, _ = self.runner.apply("placement", dataclasses.replace(plan, budget=self.budget), seconds)
        arena = self.placed.notes["placement"]["arena_bytes"]
        if record is not None:
            self.tried[record]["arena_bytes"] = arena
        return arena

    def _place_as_is(self) -> bool:
        """The start itself, placed, where its arena holds the budget (no added time): with
        the quick placement's effort where a budget is given (the ledger is charged), else with
        PLACE_SHARE of the time limit, within PLACE_SECONDS and PLACE_SHARE_SECONDS (nothing
        else follows: a longer limit packs tighter)."""
        seconds = self.ledger.place(self.ledger.quick) if self.budget is not None else \
            min(max(PLACE_SHARE * self.time_limit, PLACE_SECONDS), PLACE_SHARE_SECONDS)
        self.ledger.charge(seconds)
        arena = self._place(self.start, None, seconds)
        if self.budget is None or arena <= self.budget:
            self._keep(Best(0.0, self.placed, -1))
            return True
        self.smallest_arena = arena
        self.nearest = (arena, self.start, -1)      # its live bytes fit: the rescue may place it
        self.first_target = self.budget - self._lowering(arena)
        return False

    def _keep(self, best: Best) -> None:
        self.best = best
        self.deadline.planned = True
        self.history.append({"seconds": round(self.deadline.elapsed(), 3), "step_time_s": best.step_time,
                             "candidate": self.tried[best.record]["candidate"] if best.record >= 0 else "as is"})

    # ---- targets ----
    def _target(self, candidate: Candidate) -> int:
        return self.targets.get(candidate, self.first_target)

    def _overshot(self, candidate: Candidate, target: int, arena: int) -> None:
        """Plan `candidate` next against a target lowered by its arena's overshoot (`_lowering`)."""
        self.smallest_arena = arena if self.smallest_arena is None else min(self.smallest_arena, arena)
        self.overshot_at[candidate] = target
        self.targets[candidate] = target - self._lowering(arena)

    def _lowering(self, arena: int) -> int:
        """How far to lower a target whose plan's arena came out at `arena`: the overshoot, and
        at least MIN_LOWERING of the budget."""
        return max(arena - self.budget, int(MIN_LOWERING * self.budget))

    def _lower_failed(self, candidate: Candidate, target: int) -> None:
        """A lowered target that does not fit: next time halfway back to the last one that
        fit but overshot (once: after that the candidate keeps its last target)."""
        above = self.overshot_at.pop(candidate, None)
        if above is not None and above > target + 1:
            self.targets[candidate] = (target + above) // 2

    # ---- results ----
    def _best_so_far(self) -> str:
        if self.best is None:
            return "; past the time limit, going on to a first plan" if self.deadline.expired else ""
        arena = self.best.plan.notes.get("placement", {}).get("arena_bytes")
        return f"; best so far {self.tried[self.best.record]['candidate'] if self.best.record >= 0 else 'as is'}" \
               f", arena {format_bytes(arena)}"

    def result(self, strategies) -> Plan:
        """The best placed plan with its budget and notes["fit"]; BudgetError where none held it."""
        if self.best is None:
            raise self.failure(strategies)
        plan, record = self.best.plan, self.best.record
        if record >= 0:
            self.tried[record]["chosen"] = True
        chosen = self.tried[record] if record >= 0 else None
        note = {"target_bytes": chosen["target_bytes"] if chosen else self.budget, "tried": self.tried,
                "attempts": len(self.tried), "cut": self.deadline.cut, "history": self.history,
                "effort": self.ledger.to_dict()}
        return dataclasses.replace(plan, budget=self.budget, notes={**plan.notes, "fit": note})

    def failure(self, strategies) -> BudgetError:
        """Why nothing was kept: no candidate reached the budget, or none placed within it, or
        the time ran out first."""
        budget = self.budget
        if self.smallest_arena is not None and self.lowest <= budget:
            hint = "; the time limit cut the search short: a longer --time-limit may place it" \
                if self.deadline.cut or self.ledger.closed else ""
            return BudgetError(f"the plan's live bytes fit the budget of {format_bytes(budget)} but its arena does "
                               f"not: the smallest arena over it is {format_bytes(self.smallest_arena)} "
                               f"({self.smallest_arena:,} B){hint}", self.smallest_arena)
        missing = [s for s in ("recompute", "swap") if s not in strategies]
        hint = f"; add {' or '.join(missing)} to --strategies to go lower" if missing else ""
        if self.deadline.cut and not self.tried:
            hint = "; the time limit ran out before any plan was made: raise --time-limit"
        return BudgetError(f"the budget of {format_bytes(budget)} ({budget:,} B) cannot be met with "
                           f"{','.join(strategies) or 'no strategies'}: the smallest peak reached is "
                           f"{format_bytes(self.lowest)} ({self.lowest:,} B){hint}", self.lowest)


def drains_anything(plan: Plan) -> bool:
    """Whether draining (`passes.order.drain`) changes any of the recompute pass's base
    orders of `plan`: if not, the drained candidates would plan the same steps again (a
    drained order equal to one before it is dropped from the bases)."""
    from memsched.passes.recompute.planner import base_orders
    from memsched.passes.reuse import compute_order

    return any(name.endswith("+drain") for name in base_orders(plan, compute_order(plan.schedule), drained=True))


def climb_relaxations(step_time_at: Callable[[float], float | None], grid: list[float]) -> dict[float, float]:
    """Hill-climb the step time over the sorted `grid` of relaxations: try the points of
    RELAXATION_START there (else the largest), then the untried neighbours of the fastest
    until it has none. While none fits, step down instead (less relaxed: more recompute,
    less left to swap). `step_time_at(relax)` plans one (None: it does not fit). Returns the
    times tried (inf where none fit)."""
    times: dict[int, float] = {}

    def trial(i: int) -> None:
        found = step_time_at(grid[i])
        times[i] = float("inf") if found is None else found

    for i in [grid.index(r) for r in RELAXATION_START if r in grid] or ([len(grid) - 1] if grid else []):
        trial(i)
    while times:
        best = min(times, key=lambda i: (times[i], i))
        near = (best - 1, best + 1) if times[best] < float("inf") else (best - 1,)
        untried = [i for i in near if 0 <= i < len(grid) and i not in times]
        if not untried:
            break
        for i in untried:
            trial(i)
    return {grid[i]: t for i, t in sorted(times.items())}
