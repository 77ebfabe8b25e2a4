"""Recomputation: the pass that picks what a plan recomputes instead of keeping (planner), the
least-cost recomputation solver on a DAG that it runs (dag: Checkmate/Moccasin-style), and the
graph generators the benches and tests use (graphs)."""
