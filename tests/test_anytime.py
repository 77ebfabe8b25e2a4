"""The anytime compile: one deadline for the whole command, the same plan for the same input,
and Ctrl-C keeping the best plan found so far."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pty
import signal
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memsched import models
from memsched.deadline import Deadline, Work, unlimited
from memsched.errors import BudgetError
from memsched.frontend import lower
from memsched.onnx_utils import save_model_atomic
from memsched.passes import fit
from memsched.passes.context import PassContext, PassRunner
from memsched.passes.pipeline import compile as compile_plan

from .conftest import ROOT

SMALL = dict(batch=2, size=32, weights=False)     # a ResNet-18 whose training step needs recompute or swap at 50%


def _runner(table: dict, deadline: Deadline, judge=lambda plan: 0) -> PassRunner:
    """A pass runner over the fake passes of `table`, with `deadline`, judging each plan's peak by `judge`."""
    return PassRunner(PassContext(deadline=deadline), table, judge)


@functools.cache
def _compiled(time_limit: float):
    """SMALL's step compiled at 50% with `time_limit` and no deadline (only the ledger ends it)."""
    return compile_plan(lower(models.build("resnet18", **SMALL)), train=True, budget="50%", time_limit=time_limit,
                        deadline=unlimited())


def _plan_key(result) -> tuple:
    plan = result.plan
    return ([(s.kind, s.target, s.tier) for s in plan.schedule], plan.offsets, result.report["plan"]["arena_bytes"])


def test_the_same_compile_gives_the_same_plan():
    """Efforts are fixed shares of the time limit and the solvers keep deterministic limits, so
    two runs that no deadline cuts give the same plan, to the offset."""
    model = lower(models.build("resnet18", **SMALL))
    first = compile_plan(model, train=True, budget="50%", time_limit=5, deadline=unlimited())
    second = compile_plan(model, train=True, budget="50%", time_limit=5, deadline=unlimited())
    assert first.report["strategies"] == ["order", "reuse", "recompute", "swap"]
    assert {"recompute", "swap"} & set(first.plan.notes)
    assert _plan_key(first) == _plan_key(second)
    assert first.report["solver"]["deadline_hit"] is False and first.report["solver"]["interrupted"] is False
    assert first.report["plan"]["arena_bytes"] <= first.report["budget_bytes"]


@pytest.mark.slow
def test_a_stopped_deadline_keeps_the_best_plan_so_far():
    """A deadline stopped once the first plan fits (as Ctrl-C does) ends the search there:
    the plan returned is that first one, marked as interrupted, and it holds the budget."""
    model = lower(models.build("resnet18", **SMALL))
    deadline = unlimited()

    def say(message: str) -> None:
        if "best so far" in message:
            deadline.stop()

    result = compile_plan(model, train=True, budget="50%", time_limit=40, deadline=deadline, progress=say)
    tried = result.plan.notes["fit"]["tried"]
    assert result.report["solver"]["interrupted"] is True and result.report["solver"]["deadline_hit"] is True
    assert result.report["plan"]["arena_bytes"] <= result.report["budget_bytes"]
    assert [t["chosen"] for t in tried].count(True) == 1
    assert len(tried) < len(_compiled(40).plan.notes["fit"]["tried"])


def test_deadline_caps_and_stops():
    deadline = Deadline(100.0)
    assert deadline.cap(1.0) == 1.0 and not deadline.cut
    assert deadline.cap(1e6) <= 100.0 and deadline.cut
    stopped = []
    with deadline.stopping(lambda: stopped.append(1)):
        deadline.stop()
    assert stopped == [1] and deadline.expired and deadline.left() == 0.0
    with deadline.stopping(lambda: stopped.append(2)):     # a solver that starts after the stop stops at once
        pass
    assert stopped == [1, 2]
    assert unlimited().left() == float("inf") and not unlimited().expired


def test_reading_a_deadline_marks_nothing_stopping_work_marks_the_cut():
    deadline = Deadline(0.0)
    assert deadline.expired and not deadline.cut          # a report may ask without changing the answer
    assert deadline.cuts() and deadline.cut               # work that stops because of it says so
    assert not Deadline(1e6).cuts()


def test_an_unbounded_work_tally_still_counts_what_is_spent():
    tally = Work(math.inf)
    tally.spend(1.5)
    tally.spend(2.0)
    assert tally.spent == 3.5 and tally.left == math.inf and tally.ok()
    bounded = Work(3.0)
    bounded.spend(3.0)
    assert bounded.spent == 3.0 and bounded.left == 0.0 and not bounded.ok()


def test_a_deadline_affords_work_or_marks_the_cut_and_a_reserve_ends_it_earlier():
    deadline = Deadline(100.0)
    assert deadline.affords(1.0) and not deadline.cut
    with deadline.reserving(99.5):
        assert deadline.left() <= 0.5
        assert not deadline.affords(1.0) and deadline.cut      # not started, and said so
    assert deadline.left() > 99.0


def test_once_a_plan_is_kept_no_round_starts_that_the_deadline_cannot_afford(monkeypatch):
    """Rounds that took longer (by the clock) than the deadline has left: the search keeps its
    first plan, starts nothing more and reports the cut; where they were quick, the ledger
    alone ends it, later."""
    kept = [_fake_command(seed, 60, monkeypatch, Deadline(1000.0), slowest_round=2000.0) for seed in range(6)]
    free = [_fake_command(seed, 60, monkeypatch, Deadline(1000.0), slowest_round=0.0) for seed in range(6)]
    first = [s for s in kept if s.best is not None]
    assert first, "some seed keeps a first plan"
    for short, long in zip(kept, free):
        if short.best is not None:
            assert short.deadline.cut and not long.deadline.cut
            assert len(short.tried) < len(long.tried)


def test_an_expired_deadline_still_gives_the_first_plan():
    """With no time at all, each pass returns its heuristic answer, so the first candidate
    that fits is still planned and placed (the deadline is reported as hit)."""
    model = lower(models.build("resnet18", **SMALL))
    # 55%: at 50% of the in-place baseline only a searched plan fits, not a first heuristic one
    result = compile_plan(model, train=True, budget="55%", time_limit=5, deadline=Deadline(0.0))
    assert result.report["solver"]["deadline_hit"] is True
    assert result.report["plan"]["arena_bytes"] <= result.report["budget_bytes"]
    assert len(result.plan.notes["fit"]["tried"]) <= fit.FIT_ROUNDS


def test_the_time_kept_for_writing_the_plan_ends_the_search_after_its_first_plan():
    """A caller's reserve (the plan's write) longer than the limit: the search gives its first
    plan and stops there, reported as cut; the report itself is still made."""
    model = lower(models.build("resnet18", **SMALL))
    result = compile_plan(model, train=True, budget="55%", time_limit=600, reserve=lambda step: 1e6)
    assert result.report["solver"]["deadline_hit"] is True
    assert result.report["plan"]["arena_bytes"] <= result.report["budget_bytes"]
    assert len(result.plan.notes["fit"]["tried"]) <= fit.FIT_ROUNDS


def test_an_arena_over_the_budget_says_when_the_time_limit_cut_the_search():
    """Exit 3 for an arena that misses the budget names the smallest arena reached, and says
    when the deadline cut the search short (a longer limit may place it), not otherwise."""
    def failure(cut: bool) -> str:
        deadline = unlimited()
        deadline.cut = cut
        search = fit.FitSearch(None, 1000, 1000, ("order", "reuse", "swap"), _runner({}, deadline), 10)
        search.lowest, search.smallest_arena = 990, 1100
        error = search.failure(search.strategies)
        assert error.smallest_feasible_bytes == 1100
        return str(error)

    assert "the smallest arena over it is" in failure(False) and "--time-limit" not in failure(False)
    assert failure(True).endswith("a longer --time-limit may place it")


@dataclasses.dataclass
class _Placed:
    """Just enough of a Plan for the fit search's rescue: a budget and notes."""
    budget: int | None = None
    notes: dict = dataclasses.field(default_factory=dict)


def _placement(efforts: list):
    """A placement pass whose arena holds a budget of 1,000 B only with 2.5 s or more (990 B;
    1,100 B with less); the seconds of each call go to `efforts`."""
    def placement(plan, seconds, context):
        efforts.append(seconds)
        return dataclasses.replace(plan, notes={"placement": {"arena_bytes": 990 if seconds >= 2.5 else 1100}})
    return placement


def test_the_rescue_places_the_nearest_attempt_again_with_more_time():
    """Where every attempt's arena overshot the budget, the one nearest it is placed once more
    with RESCUE_SECONDS, doubling while the ledger affords it, and kept where that placement
    holds the budget; a search that kept a plan, or whose time is up, places nothing again."""
    efforts = []

    def search(deadline, time_limit: float = 40) -> fit.FitSearch:
        found = fit.FitSearch(None, 1000, 1000, ("order", "reuse", "swap"),
                              _runner({"placement": _placement(efforts)}, deadline), time_limit)
        found.tried = [{"candidate": "swap", "target_bytes": 1000, "step_time_s": 1.5, "fits": True}]
        found.nearest, found.smallest_arena, found.lowest = (1100, _Placed(), 0), 1100, 980
        return found

    rescued = search(unlimited())
    rescued.rescue()
    assert efforts == [fit.RESCUE_SECONDS, 2 * fit.RESCUE_SECONDS] and rescued.best.step_time == 1.5
    assert rescued.result(rescued.strategies).notes["placement"]["arena_bytes"] == 990
    rescued.rescue()                                  # a plan is kept: nothing placed again
    assert len(efforts) == 2
    late = search(Deadline(0))
    late.rescue()
    assert len(efforts) == 2 and late.best is None
    short = search(unlimited(), time_limit=20)        # the ledger (5 s) affords 2 s, not 4 s more
    short.rescue()
    assert efforts[2:] == [fit.RESCUE_SECONDS] and short.best is None and short.ledger.closed
    assert "a longer --time-limit may place it" in str(short.failure(short.strategies))


def test_the_ledger_closes_at_the_first_price_it_cannot_afford():
    """Efforts are fixed from FLOOR_SECONDS of time limit on and shrink below it; the ledger
    spends WORK_SHARE of the limit, and once it refuses it refuses everything after."""
    assert fit.Ledger(10).quick == fit.Ledger(600).quick == fit.QUICK_SECONDS
    assert fit.Ledger(600).level(3) == 4 * fit.IMPROVE_SECONDS
    assert fit.Ledger(5).quick == fit.QUICK_SECONDS / 2 and fit.Ledger(5).order == fit.ORDER_SECONDS / 2
    ledger = fit.Ledger(40)
    assert ledger.budget == fit.WORK_SHARE * 40
    share = ledger.budget * 0.6
    assert ledger.take(share) and not ledger.take(share) and ledger.closed
    assert not ledger.take(ledger.budget * 0.1)        # closed for good, even for what would fit
    assert ledger.spent == share
    ledger.charge(share)                               # the work a first plan needs is charged unasked
    assert ledger.spent == 2 * share


@dataclasses.dataclass
class _FakePlan:
    """A plan as the fit search sees it: a budget, notes (its step time and peak) and a hardware."""
    budget: int | None = None
    notes: dict = dataclasses.field(default_factory=dict)
    hardware: None = None


def _fake_passes(seed: int) -> dict:
    """Recompute, swap and placement passes whose answers are pseudo-random in (seed, pass,
    budget, effort, input): more effort may give a slower plan, a larger arena or none."""
    import random

    def planner(name: str):
        def apply(plan, effort, context):
            r = random.Random(repr((seed, name, plan.budget, round(effort, 6), plan.notes.get("time"))))
            if r.random() < 0.2:
                raise BudgetError("not this time", plan.budget + r.randrange(1, 200))
            time_s = plan.notes.get("time", 1.0) + r.random()
            return _FakePlan(plan.budget, {**plan.notes, name: {"overhead": time_s - 1.0}, "time": time_s,
                                           "peak": plan.budget - r.randrange(100)}, None)
        return apply

    def placement(plan, seconds, context):
        r = random.Random(repr((seed, plan.notes.get("time"), plan.budget, round(seconds, 6))))
        return dataclasses.replace(plan, notes={**plan.notes, "placement": {
            "arena_bytes": plan.notes["peak"] + r.randrange(-20, 120)}})

    return {"recompute": planner("recompute"), fit.DRAINED: planner("recompute"), "swap": planner("swap"),
            "placement": placement}


def _fake_command(seed: int, time_limit: float, monkeypatch, deadline: Deadline | None = None,
                  slowest_round: float | None = None) -> fit.FitSearch:
    """The fit part of a compile (first plans, the improvement levels, the rescue) with the fake
    passes and no deadline (or `deadline`): only the ledger ends it. `slowest_round`: the wall
    time the rounds are taken to have needed, from the first plan on."""
    from types import SimpleNamespace

    from memsched.passes.pipeline import improvement_levels

    monkeypatch.setattr(fit, "simulate", lambda plan, hardware, costs: SimpleNamespace(step_time=plan.notes["time"]))
    monkeypatch.setattr(fit, "drains_anything", lambda plan: seed % 2 == 0)
    deadline, ledger = deadline or unlimited(), fit.Ledger(time_limit)
    search = fit.FitSearch(_FakePlan(None, {"time": 1.0, "peak": 2000}), 2000, 1000,
                           ("order", "reuse", "recompute", "swap"),
                           _runner(_fake_passes(seed), deadline, judge=lambda plan: plan.notes["peak"]), time_limit,
                           ledger=ledger)
    search.first_plans()
    search.joint_climb()
    if slowest_round is not None:
        search.slowest_round = slowest_round
    improvement_levels({"given": search}, ledger, deadline)
    search.rescue()
    return search


@pytest.mark.parametrize("seed", range(4))
def test_a_second_search_makes_its_first_plans_after_the_first_spent_the_ledger(seed, monkeypatch):
    """The micro-batched step's search comes after the given step's first plans, which may have
    spent the ledger: its own first plans still come, uncharged, and then the search with the
    faster plan climbs first."""
    from types import SimpleNamespace

    from memsched.passes.pipeline import after_first_plans

    monkeypatch.setattr(fit, "simulate", lambda plan, hardware, costs: SimpleNamespace(step_time=plan.notes["time"]))
    monkeypatch.setattr(fit, "drains_anything", lambda plan: False)
    deadline, ledger = unlimited(), fit.Ledger(60)
    searches = {name: fit.FitSearch(_FakePlan(None, {"time": 1.0, "peak": 2000}), 2000, 1000,
                                    ("order", "reuse", "recompute", "swap"),
                                    _runner(_fake_passes(seed + k), deadline, judge=lambda plan: plan.notes["peak"]),
                                    60, ledger=ledger) for k, name in enumerate(("given", "split"))}
    searches["given"].first_plans()
    deadline.planned = True                            # whether or not it kept one: the other rule
    ledger.charge(ledger.budget)                       # the given step's first plans spent it all
    spent = ledger.spent
    searches["split"].first_plans()
    assert searches["split"].tried and ledger.spent == spent
    climbed = []
    monkeypatch.setattr(fit.FitSearch, "climb", lambda self, drained, effort: climbed.append(self))
    after_first_plans(searches, ledger, deadline)
    fastest_first = sorted(searches, key=lambda n: (searches[n].best.step_time if searches[n].best else math.inf, n))
    assert climbed == [searches[n] for n in fastest_first if searches[n].climbs]


@given(seed=st.integers(0, 10**6))
@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_longer_limit_never_gives_a_slower_plan(seed, monkeypatch):
    """From FLOOR_SECONDS on, the attempts of a shorter limit are a prefix of a longer one's
    (counted effort, not the clock), so its plan is never slower: even with passes whose
    answers get worse with more effort."""
    limits = (fit.FLOOR_SECONDS, 15, 25, 40, 80, 160)
    searches = [_fake_command(seed, limit, monkeypatch) for limit in limits]
    for shorter, longer in zip(searches, searches[1:]):
        key = [(t["candidate"], t["target_bytes"], t["effort_s"]) for t in shorter.tried]
        assert key == [(t["candidate"], t["target_bytes"], t["effort_s"]) for t in longer.tried][:len(key)]
        if shorter.best is not None:
            assert longer.best is not None and longer.best.step_time <= shorter.best.step_time


@pytest.mark.slow     # 20 s of compiles; test_a_longer_limit_never_gives_a_slower_plan covers the rule fast
def test_a_longer_limit_gives_the_same_attempts_and_then_more():
    """On a real step (ResNet-18's, at 50%) with no deadline: the attempts at 20 s are the
    first of those at 40 s, and the plan is at least as fast."""
    short, long = _compiled(20), _compiled(40)
    tried = [[(t["candidate"], t["target_bytes"], t["effort_s"]) for t in r.plan.notes["fit"]["tried"]]
             for r in (short, long)]
    assert tried[0] == tried[1][:len(tried[0])] and len(tried[1]) > len(tried[0])
    assert long.report["plan"]["step_time_s"] <= short.report["plan"]["step_time_s"]
    assert short.plan.notes["fit"]["effort"]["closed"]


class Terminal:
    """`memsched compile ARGS` with its stderr on a pseudo-terminal (so the progress line shows),
    read continuously by a thread so the process never blocks on a full terminal."""

    def __init__(self, args: list[str]):
        reader, writer = pty.openpty()
        self.process = subprocess.Popen([sys.executable, "-m", "memsched", "compile", *args], cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=writer, stdin=subprocess.DEVNULL)
        os.close(writer)
        self.reader, self.screen = reader, b""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.reader, 65536)
            except OSError:
                return
            if not data:
                return
            self.screen += data

    def wait_for(self, text: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while text.encode() not in self.screen and time.monotonic() < end and self.process.poll() is None:
            time.sleep(0.2)
        return text.encode() in self.screen

    def finish(self, timeout: float) -> str:
        try:
            stdout, _ = self.process.communicate(timeout=timeout)
        finally:
            self.process.kill()
            self.thread.join(timeout=5)
            os.close(self.reader)
        return stdout.decode()

    @property
    def text(self) -> str:
        return self.screen.decode(errors="replace")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return save_model_atomic(models.build("resnet18", batch=2, size=32), tmp_path_factory.mktemp("m") / "r18.onnx")


def test_ctrl_c_writes_the_best_plan_so_far(small_model, tmp_path):
    """One Ctrl-C once a plan fits: the search stops and the best plan is written, exit 0."""
    out = tmp_path / "plan.onnx"
    terminal = Terminal([str(small_model), "--train", "--budget", "50%", "--time-limit", "120", "-o", str(out),
                         "--json"])
    assert terminal.wait_for("best so far", timeout=240), terminal.text[-2000:]
    terminal.process.send_signal(signal.SIGINT)
    report = json.loads(terminal.finish(timeout=120))
    assert terminal.process.returncode == 0, terminal.text[-2000:]
    assert report["solver"]["interrupted"] is True and report["written"]["plan"] == str(out)
    assert report["plan"]["arena_bytes"] <= report["budget_bytes"] and out.exists()
    assert "interrupted" in terminal.text


def test_a_second_ctrl_c_aborts_with_nothing_written(small_model, tmp_path):
    out = tmp_path / "plan.onnx"
    terminal = Terminal([str(small_model), "--train", "--budget", "50%", "--time-limit", "120", "-o", str(out)])
    assert terminal.wait_for("order", timeout=240), terminal.text[-2000:]
    terminal.process.send_signal(signal.SIGINT)
    time.sleep(1.0)     # two signals sent at once may arrive as one
    terminal.process.send_signal(signal.SIGINT)
    terminal.finish(timeout=120)
    assert terminal.process.returncode == 130, terminal.text[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_a_command_deadline_counts_from_the_process_start():
    """`for_command` starts the clock when the interpreter started, not when the command's
    code runs: a process that spent 1.5 s before asking has at most 8.5 s of a 10 s limit
    left (one-sided: load only makes the process older)."""
    code = ("import time; time.sleep(1.5); from memsched.deadline import for_command, process_age; "
            "print(process_age(), for_command(10).left())")
    age, left = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                          check=True).stdout.split())
    assert age >= 1.45 and left <= 10 - 1.45


def test_a_ctrl_c_while_the_plan_is_written_finishes_the_write(tmp_path, monkeypatch, capsys):
    """A first Ctrl-C that lands while the plan is being written is still the first: the
    plan is written whole and the command ends as a finished compile (exit 0), not
    "interrupted" with the plan already there."""
    import onnx

    from memsched import emit
    from memsched.cli import main
    from tests.graphs import mlp_model

    model, out = tmp_path / "mlp.onnx", tmp_path / "plan.onnx"
    save_model_atomic(mlp_model(), model)
    write = emit.write_plan

    def interrupted_write(plan, path):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)             # the handler runs here, between bytecodes of the main thread
        return write(plan, path)

    monkeypatch.setattr(emit, "write_plan", interrupted_write)
    assert main(["compile", str(model), "--train", "--time-limit", "20", "-o", str(out)]) == 0
    assert "interrupted: finishing with the best plan" in capsys.readouterr().err
    assert emit.read_plan(out).schedule and onnx.load(str(out)).graph.node


def test_the_rescue_places_the_start_again_where_its_live_bytes_fit():
    """With order and reuse alone, a start whose live bytes fit the budget but whose first
    arena overshoots is placed once more by the rescue, and kept as it is."""
    efforts = []
    search = fit.FitSearch(_Placed(), 980, 1000, ("order", "reuse"),
                           _runner({"placement": _placement(efforts)}, unlimited()), 40)
    search.first_plans()
    assert search.best is None and efforts[-1] < 2.5
    search.rescue()
    assert efforts[-1] >= 2.5 and search.best.step_time == 0.0 and search.best.record == -1
    assert search.result(search.strategies).notes["placement"]["arena_bytes"] == 990


def test_an_attempt_past_the_time_limit_says_why_the_search_goes_on():
    """With no plan kept when the time is up, the passes still give their quick answers until
    one fits: each attempt's progress line says so, so a late answer is not a silent overrun."""
    said = []

    def swap(plan, seconds, context):
        raise BudgetError("not this time", 1100)

    for deadline, late in ((Deadline(0.0), True), (unlimited(), False)):
        said.clear()
        search = fit.FitSearch(_Placed(), 1200, 1000, ("order", "reuse", "swap"),
                               _runner({"swap": swap}, deadline, judge=lambda plan: 900), 10, say=said.append)
        search.attempt(fit.Candidate("swap"), 0.0, 1)
        assert len(said) == 1 and said[0].endswith("past the time limit, going on to a first plan") == late
