"""The anytime compile: one deadline for the whole command, the same plan for the same input,
and Ctrl-C keeping the best plan found so far."""
from __future__ import annotations

import dataclasses
import json
import os
import pty
import signal
import subprocess
import sys
import threading
import time

import pytest

import models
from memsched.deadline import Deadline, unlimited
from memsched.errors import BudgetError
from memsched.frontend import lower
from memsched.onnx_utils import save_model_atomic
from passes import fit
from passes.pipeline import compile as compile_plan

from .conftest import ROOT

SMALL = dict(batch=2, size=32, weights=False)     # a ResNet-18 whose training step needs recompute or swap at 50%


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


def test_a_stopped_deadline_keeps_the_best_plan_so_far():
    """A deadline stopped once the first plan fits (as Ctrl-C does) ends the search there:
    the plan returned is that first one, marked as interrupted, and it holds the budget."""
    model = lower(models.build("resnet18", **SMALL))
    deadline = unlimited()

    def say(message: str) -> None:
        if "best so far" in message:
            deadline.stop()

    result = compile_plan(model, train=True, budget="50%", time_limit=5, deadline=deadline, progress=say)
    tried = result.plan.notes["fit"]["tried"]
    assert result.report["solver"]["interrupted"] is True and result.report["solver"]["deadline_hit"] is True
    assert result.report["plan"]["arena_bytes"] <= result.report["budget_bytes"]
    assert [t["chosen"] for t in tried].count(True) == 1
    whole = compile_plan(model, train=True, budget="50%", time_limit=5, deadline=unlimited())
    assert len(tried) < len(whole.plan.notes["fit"]["tried"])


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


def test_an_expired_deadline_still_gives_the_first_plan():
    """With no time at all, each pass returns its heuristic answer, so the first candidate
    that fits is still planned and placed (the deadline is reported as hit)."""
    model = lower(models.build("resnet18", **SMALL))
    # 55%: at 50% of the in-place baseline only a searched plan fits, not a first heuristic one
    result = compile_plan(model, train=True, budget="55%", time_limit=5, deadline=Deadline(0.0))
    assert result.report["solver"]["deadline_hit"] is True
    assert result.report["plan"]["arena_bytes"] <= result.report["budget_bytes"]
    assert len(result.plan.notes["fit"]["tried"]) <= fit.FIT_ROUNDS


def test_an_arena_over_the_budget_says_when_the_time_limit_cut_the_search():
    """Exit 3 for an arena that misses the budget names the smallest arena reached, and says
    when the deadline cut the search short (a longer limit may place it), not otherwise."""
    def failure(cut: bool) -> str:
        deadline = unlimited()
        deadline.cut = cut
        search = fit.Search(None, 1000, 1000, ("order", "reuse", "swap"), {}, None, 10, deadline)
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
    """A placement pass whose arena holds a budget of 1,000 B only with RESCUE of a 10 s time
    limit (990 B; 1,100 B with less); the seconds of each call go to `efforts`."""
    def placement(plan, seconds, deadline):
        efforts.append(seconds)
        return dataclasses.replace(plan, notes={"placement": {"arena_bytes": 990 if seconds >= 2.5 else 1100}})
    return placement


def test_the_rescue_places_the_nearest_attempt_again_with_more_time():
    """Where every attempt's arena overshot the budget, the one nearest it is placed once more
    with RESCUE of the time limit and kept where that placement holds the budget; a search
    that kept a plan, or whose time is up, places nothing again."""
    efforts = []

    def search(deadline) -> fit.Search:
        found = fit.Search(None, 1000, 1000, ("order", "reuse", "swap"), {"placement": _placement(efforts)},
                           lambda name, apply, plan: (apply(plan), 0), 10, deadline)
        found.tried = [{"candidate": "swap", "target_bytes": 1000, "step_time_s": 1.5, "fits": True}]
        found.nearest, found.smallest_arena, found.lowest = (1100, _Placed(), 0), 1100, 980
        return found

    rescued = search(unlimited())
    rescued.rescue()
    assert efforts == [fit.RESCUE * 10] and rescued.best.step_time == 1.5
    assert rescued.result(rescued.strategies).notes["placement"]["arena_bytes"] == 990
    rescued.rescue()                                  # a plan is kept: nothing placed again
    expired = Deadline(0)
    late = search(expired)
    late.rescue()
    assert efforts == [fit.RESCUE * 10] and late.best is None


class Terminal:
    """`memsched compile ARGS` with its stderr on a pseudo-terminal (so the progress line shows),
    read continuously by a thread so the process never blocks on a full terminal."""

    def __init__(self, args: list[str]):
        reader, writer = pty.openpty()
        self.process = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "compile", *args], cwd=ROOT,
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


def test_the_rescue_places_the_start_again_where_its_live_bytes_fit():
    """With order and reuse alone, a start whose live bytes fit the budget but whose first
    arena overshoots is placed once more with RESCUE of the time limit, and kept as it is."""
    efforts = []
    search = fit.Search(_Placed(), 980, 1000, ("order", "reuse"), {"placement": _placement(efforts)},
                        lambda name, apply, plan: (apply(plan), 0), 10, unlimited())
    search.first_plans()
    assert search.best is None and efforts[-1] < fit.RESCUE * 10
    search.rescue()
    assert efforts[-1] == fit.RESCUE * 10 and search.best.step_time == 0.0 and search.best.record == -1
    assert search.result(search.strategies).notes["placement"]["arena_bytes"] == 990


def test_an_attempt_past_the_time_limit_says_why_the_search_goes_on():
    """With no plan kept when the time is up, the passes still give their quick answers until
    one fits: each attempt's progress line says so, so a late answer is not a silent overrun."""
    said = []

    def swap(plan, seconds, deadline):
        raise BudgetError("not this time", 1100)

    for deadline, late in ((Deadline(0.0), True), (unlimited(), False)):
        said.clear()
        search = fit.Search(_Placed(), 1200, 1000, ("order", "reuse", "swap"), {"swap": swap},
                            lambda name, apply, plan: (apply(plan), 900), 10, deadline, say=said.append)
        search.attempt(fit.Candidate("swap"), 0.0, 1)
        assert len(said) == 1 and said[0].endswith("past the time limit, going on to a first plan") == late
