"""The runtime: run a Plan on ONNX Runtime exactly as scheduled, in one arena, and train with it.

Why its own executor: a plan's memory figures are only believable when a real run keeps
to them. The schedule's op runs are cut into segments, each a stretch of consecutive op
runs (on CUDA up to the next swap and up to an op that waits for a copy; on the CPU a swap
copy is an Identity node of the segment, bound from the arena to its store), and each segment
runs as one ONNX Runtime session through IOBinding: every tensor its ops read from outside is
a session input and every tensor they write is a session output, bound at its planned offset
in one preallocated arena (a numpy buffer on CPU, one device allocation on CUDA). ONNX
Runtime therefore allocates no tensor of its own; the sessions have no initializers and no
memory arena of their own (kernels' scratch comes from one arena that all of them share,
memsched.ort.shared_scratch_arena, kept from step to step), are built once and reused by
every step. Parameters, buffers and optimizer state live only in the arena: the first step
loads them from the graph, later steps move each `<name>.updated` into its place. Constants
and fixed integer values (shapes, axes) are read from host arrays (`host_constants`).
Swap-outs copy bytes to a host tier's store (DRAM: host buffers, pinned on CUDA; NVDIMM: a
memory-mapped file) and swap-ins copy them back; recomputations re-run the op; frees
release the slot.

Before anything runs the plan is judged (memory.validate: residency, budget, placement),
then rehearsed: the executor walks the byte ranges it is about to bind, keeping its own
table of live slots. A read of a range that does not hold the tensor, or a write over a
live slot, is a ScheduleError naming the tensor; the live bytes of that table are the
measured figures, and they must equal the memory model's at every step. The process's real
memory (RSS growth, `RunResult.process`) is measured beside them: the arena, the stores and
what the executor costs on top.

`check=True` also runs the unscheduled graph in one plain ONNX Runtime session (same
options: the same graph optimisations, see memsched.ort.OPTIMIZATION, same thread count,
every initializer fed as an input so no kernel sees a constant the segments do not) and
compares every output of every step; on CPU they must be bit-identical. Bytes released
during a checked run are filled with NaN bytes after the segment or copy that released them
(those not written again by then), so a plan that read freed memory could not pass by luck.

Where each part lives: `run.py` runs a plan (`run_plan`, `PlanRunner`, the inputs, each
step's loading and execution); `program.py` lowers a plan to a program (no ONNX Runtime
call); `rehearsal.py` is the executor's own accounting; `device.py` the arena, the stores and
the sessions (CUDA's runtime calls in memsched.cuda); `check.py` the reference run and the
comparison; `trainer.py` and `train_loop.py` train with the same program.
"""
from .check import compare_outputs, feed_back, reference_model
from .program import Hooks, segment_model
from .run import PlanRunner, RunResult, prepare_inputs, run_plan, steady_step_time
from .trainer import Trainer

__all__ = ["run_plan", "RunResult", "PlanRunner", "Hooks", "prepare_inputs", "feed_back", "compare_outputs",
           "reference_model", "segment_model", "steady_step_time", "Trainer"]
