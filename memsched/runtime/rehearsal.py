"""The rehearsal: before anything runs, the executor walks the byte ranges it is about to bind
with its own table of live slots. A read of a range that does not hold the tensor, or a
write over a live slot, is a ScheduleError naming the tensor; the table's live bytes are the
run's measured figures, which must equal the memory model's at every step."""

import numpy as np

from ..errors import ScheduleError
from ..memory import MemoryProfile
from .program import Copy, Program, Run
from ..schedule import StepKind


# ---- the rehearsal: the executor's own accounting -------------------------------------------
def rehearse(program: Program, profile: MemoryProfile) -> tuple[np.ndarray, int]:
    """Walk the byte ranges the program binds; return measured live bytes per step, high water.

    Each slot is (tensor, lo, hi). Reading a range that does not hold the tensor, or writing
    over a live slot, is a ScheduleError naming the tensor."""
    live: dict[tuple[str, int], tuple[int, int]] = {}
    high_water = 0

    ends = {r.key: r.end for r in profile.residencies}

    def allocate(key, lo, hi, shares, step):
        nonlocal high_water
        if shares is not None:
            if live.get(shares) != (lo, hi):
                raise ScheduleError(f"tensor '{key[0]}' takes the storage of '{shares[0]}' at step {step}, "
                                    f"which is not where that tensor is")
            live[key] = live[shares]
            if ends[shares] == step:      # written over; a view shares with a source read later
                del live[shares]
        else:
            if hi > lo:
                for other, (a, b) in live.items():
                    if a < hi and lo < b:
                        raise ScheduleError(f"tensor '{key[0]}' is written at step {step} over arena bytes "
                                            f"[{a},{b}) of tensor '{other[0]}', which is still live")
            live[key] = (lo, hi)
        high_water = max(high_water, hi)

    def read(tensor, lo, hi, step):
        if not any(k[0] == tensor and span == (lo, hi) for k, span in live.items()):
            raise ScheduleError(f"tensor '{tensor}' is read at step {step} from arena bytes [{lo},{hi}), "
                                f"which do not hold it (freed too early?)")

    for key, lo, hi in program.initial:
        allocate(key, lo, hi, None, 0)
    n = len(program.actions)
    measured = np.zeros(n, dtype=np.int64)
    for i, action in enumerate(program.actions):
        if isinstance(action, Run):
            for tensor, lo, hi in action.reads:
                read(tensor, lo, hi, i)
            for key, lo, hi, shares in action.writes:
                allocate(key, lo, hi, shares, i)
        elif isinstance(action, Copy):
            if action.kind == StepKind.SWAP_OUT:
                read(action.key[0], action.lo, action.hi, i)
            else:
                allocate(action.key, action.lo, action.hi, None, i)
        measured[i] = sum(hi - lo for lo, hi in set(live.values()))
        for key, lo, hi, kept in program.releases[i]:
            live.pop(key, None)
    # compared as lists: np.array_equal pages in 192 KiB of numpy's code, a seventh of the
    # overhead a small step's run has beside its arena
    planned = profile.live_bytes.tolist()
    if measured.tolist() != planned:
        step = next(i for i, (m, p) in enumerate(zip(measured.tolist(), planned)) if m != p)
        raise ScheduleError(f"the executor's accounting ({int(measured[step])} bytes) disagrees with the "
                            f"memory model ({planned[step]} bytes) at step {step}")
    return measured, high_water
