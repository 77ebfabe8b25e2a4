"""Swapping to host memory: the pass (planner), the transfer model it prices with (model), the
heuristic that picks what to swap (heuristic), and the replays that fill its gaps (gaps)."""
