"""Train with a plan: the Trainer runs a compiled training step batch after batch.

A Trainer is built once from a plan (a path or a `Plan`) and keeps its ONNX Runtime
sessions, its arena and its host stores (memsched.runtime.PlanRunner) for as long as it lives: each
`step(batch)` copies the batch into the step's input buffers, writes the hyperparameters of
this step (a learning-rate schedule's value), runs the step exactly as planned and returns
the loss. Parameters, optimizer states and BatchNorm running statistics never leave the
arena between steps: each step's `<name>.updated` becomes the next step's `<name>`.

Every batch is checked before it runs: each of the step's inputs present, none unknown, each
of its declared shape (the plan's batch size) and dtype. A wrong batch is a UserError, never
zeros, a made-up value or the previous batch. A batch is any mapping from input name to a
numpy array or a CPU torch tensor (anything numpy reads). On the CPU a C-contiguous array is
read in place, without a copy, as a plain session reads its feeds (the sessions are bound to
its bytes for the step); any other layout (Fortran order, a strided slice) is copied into the
step's own input buffer first. An input the plan keeps in the arena (swapped, written over in
place) and every input on CUDA is copied there.

The weights come out as a checkpoint (`save_checkpoint`: safetensors, written atomically;
`load_checkpoint` resumes bit-identically) and as an inference model
(`memsched.inference.export_inference`). `load_weights` takes an ONNX model, a safetensors
file or a PyTorch `state_dict` before training (fine-tuning).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..emit import read_plan
from ..errors import UserError
from .program import Hooks
from .run import PlanRunner
from ..frontend import read_model
from ..ir import tensor_value
from ..onnx_utils import write_file_atomic
from ..schedule import Plan
from ..step_info import StepInfo, forward_output, step_info

CHECKPOINT_FORMAT = "memsched-checkpoint-1"
# entries of a state_dict that are not tensors of the step (PyTorch's BatchNorm counter)
IGNORED_STATE = ("num_batches_tracked",)


@dataclass
class StepResult:
    """One training step: its loss, the outputs asked for, the hyperparameters it used."""

    step: int                       # optimizer steps taken before this one (0 for the first)
    loss: float
    lr: float
    seconds: float                  # the run of the step, batch copy included
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


class Trainer:
    """Train with `plan`: `step(batch)` per batch. See the module doc.

    `lr_schedule`: a callable from the step number (0 for the first step) to the learning
    rate, or None for the plan's own. `hyperparameters` can also be changed directly
    (`trainer.hyperparameters["lr"] = 0.01`); a schedule sets lr before every step. `before`
    and `after`: step hooks as `memsched.runtime.run_plan` takes them (CPU only; a data-parallel
    rank's all-reduces, `memsched.runtime.distributed.rank_of`). `tf32` False keeps float32
    kernels on CUDA off TF32 tensor cores (for losses compared with the CPU's)."""

    def __init__(self, plan: Plan | str | os.PathLike, device: str = "cpu", threads: int = 0,
                 nvdimm_dir: str | None = None, allow_fallback: bool = True,
                 lr_schedule: Callable[[int], float] | None = None, before: dict | None = None,
                 after: dict | None = None, tf32: bool = True):
        if not isinstance(plan, Plan):
            plan = read_plan(plan)
        self.plan = plan
        self.graph = plan.graph
        self.info: StepInfo = step_info(self.graph)
        self.hyperparameters: dict[str, float] = dict(self.info.hyperparameters)
        self.lr_schedule = lr_schedule
        self.step_count = 0
        self.inputs = list(self.graph.inputs)
        # input -> (numpy dtype, shape with the batch first): what every batch must hold
        self.input_types = {name: (np.dtype(helper.tensor_dtype_to_np_dtype(self.graph.tensors[name].dtype)),
                                   tuple(self.graph.tensors[name].shape)) for name in self.inputs}
        # the batch: dimension 0 of the labels or targets, else of the first input that has one
        batched = [n for n in self.info.extra_inputs if n in self.input_types] + self.inputs
        first = next((self.input_types[n][1] for n in batched if self.input_types[n][1]), ())
        self.batch_size = first[0] if first else 1
        self._buffers = {name: np.empty(shape, dtype) for name, (dtype, shape) in self.input_types.items()}
        self._runner = PlanRunner(plan, device, threads, nvdimm_dir, feeds=self._buffers,
                                  hooks=Hooks(before or {}, after or {}), allow_fallback=allow_fallback, tf32=tf32)
        self.device = self._runner.device
        self.fallback = self._runner.fallback
        self._pending: dict[str, np.ndarray] = {}    # statics to load before the next step
        self._ran = False                             # a step ran since the statics were loaded
        # weights the step reads but does not update (frozen ones; every one without an
        # optimizer): loaded values are written before every step, as the graph's are
        carried = set(self.info.carried)
        self.fixed_weights = [name for name, t in self.graph.tensors.items()
                              if t.is_static and t.kind in ("parameter", "buffer") and name not in carried]
        self._fixed_values: dict[str, np.ndarray] = {}
        self._classes = _class_count(self.graph, self.info)

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        self._runner.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    # ---- stepping ----------------------------------------------------------------------
    def step(self, batch: Mapping[str, object], outputs: tuple[str, ...] | list[str] = ()) -> StepResult:
        """Run one training step on `batch`; return its loss (and the graph outputs named in
        `outputs`, as arrays)."""
        start = time.perf_counter()
        unknown = [name for name in outputs if name not in self._runner.program.finals]
        if unknown:
            raise UserError(f"the step has no output named '{unknown[0]}'")
        feeds = self._feeds(batch)
        if self.lr_schedule is not None:
            self.hyperparameters["lr"] = self.lr_schedule(self.step_count)
        values = self._hyperparameter_values()
        values.update(self._fixed_values)
        if self._pending:
            values.update(self._pending)
            self._runner.reload()
        try:
            self._runner.step(feeds, values)
        except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own types; one line, not a trace
            raise UserError(f"ONNX Runtime failed during step {self.step_count}: "
                            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}; "
                            f"the weights may be half updated: load a checkpoint before going on") from None
        self._pending = {}
        self._ran = True
        loss = float(self._runner.read("loss").reshape(()))
        result = StepResult(self.step_count, loss, self.hyperparameters.get("lr", math.nan),
                            time.perf_counter() - start, {name: self._runner.read(name) for name in outputs})
        self.step_count += 1
        return result

    def _feeds(self, batch: Mapping[str, object]) -> dict[str, np.ndarray]:
        """The step's inputs from `batch`, every one checked before any is bound: those the
        sessions read in place bound to the batch's bytes (another layout copied into the
        step's own buffer first), the others handed over to be written into the arena."""
        if not isinstance(batch, Mapping):
            raise UserError(f"a batch is a mapping from input name to array, not {type(batch).__name__}")
        missing = [name for name in self.inputs if name not in batch]
        if missing:
            raise UserError(f"the batch has no '{missing[0]}' (the step's inputs: {', '.join(self.inputs)})")
        unknown = [name for name in batch if name not in self.input_types]
        if unknown:
            raise UserError(f"the step has no input named '{unknown[0]}' (its inputs: {', '.join(self.inputs)})")
        arrays = {}
        for name, (dtype, shape) in self.input_types.items():
            value = _as_array(batch[name], name)
            if value.dtype != dtype:
                raise UserError(f"input '{name}' must be {dtype}, not {value.dtype}")
            if value.shape != shape:
                what = (f"a batch of {value.shape[0]} (the plan's batch size is {shape[0]})"
                        if value.ndim == len(shape) and value.shape[1:] == shape[1:] and shape else f"{value.shape}")
                raise UserError(f"input '{name}' must have shape {shape}, not {what}")
            arrays[name] = value
        labels = arrays.get("labels") if self._classes else None
        if labels is not None and labels.size and (labels.min() < 0 or labels.max() >= self._classes):
            raise UserError(f"the labels must lie in 0..{self._classes - 1} (the model's {self._classes} classes); "
                            f"this batch holds {int(labels.min())}..{int(labels.max())}")
        feeds = {}
        for name, value in arrays.items():
            if name in self._runner.host_inputs:
                if not value.flags.c_contiguous:
                    np.copyto(self._buffers[name], value)
                    value = self._buffers[name]
                self._runner.bind_input(name, value)        # read in place, as a plain session reads a feed
            feeds[name] = np.ascontiguousarray(value)
        self._held = feeds                                  # the arrays the sessions read, alive until the next step
        return feeds

    def _hyperparameter_values(self) -> dict[str, np.ndarray]:
        """Each hyperparameter tensor's value for the next step, from `hyperparameters`."""
        values = {}
        for name, tensors in self.info.hyperparameter_tensors.items():
            value = self.hyperparameters.get(name)
            number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            value = float(value) if number else math.nan
            if not math.isfinite(value) or value < 0:
                raise UserError(f"hyperparameter {name} must be a finite number from 0 up, not "
                                f"{self.hyperparameters.get(name)!r}")
            for tensor in tensors:
                dtype = helper.tensor_dtype_to_np_dtype(self.graph.tensors[tensor].dtype)
                values[tensor] = np.asarray(value, dtype=dtype)
        return values

    # ---- state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of the values the next step starts from: parameters (frozen ones too),
        optimizer states and buffers, by tensor name."""
        state = {}
        for name in self.info.carried:
            if name in self._pending:
                state[name] = np.array(self._pending[name])
            elif self._ran:
                state[name] = self._runner.read(f"{name}.updated")
            else:
                state[name] = np.array(tensor_value(self.graph.tensors[name], self.graph.base_dir))
        for name in self.fixed_weights:
            value = self._fixed_values.get(name)
            state[name] = np.array(value if value is not None else tensor_value(self.graph.tensors[name],
                                                                                self.graph.base_dir))
        return state

    def load_state_dict(self, state: Mapping[str, object], strict: bool = True) -> list[str]:
        """Load tensors by name into the next step's starting values; returns the names loaded.
        With `strict`, every trained parameter must be given. Every name must be a parameter
        (trained or frozen), an optimizer state or a buffer of the step, with its shape; values
        are copied and cast to its dtype."""
        carried = set(self.info.carried)
        known = carried | set(self.fixed_weights)
        loaded = {}
        for name, value in state.items():
            if name.rsplit(".", 1)[-1] in IGNORED_STATE:
                continue
            if name not in known:
                shown = ", ".join(self.info.parameters[:5]) + (", ..." if len(self.info.parameters) > 5 else "")
                raise UserError(f"'{name}' is no parameter, optimizer state or buffer of this step "
                                f"(its parameters: {shown})")
            t = self.graph.tensors[name]
            array = _as_array(value, name)
            if array.shape != tuple(t.shape):
                raise UserError(f"'{name}' has shape {array.shape}; the step's has {tuple(t.shape)}")
            dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
            if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                raise UserError(f"'{name}' is {array.dtype}; the step's is {np.dtype(dtype)}")
            loaded[name] = np.array(array, dtype=dtype, order="C")     # a copy, 0-d kept 0-d
        if strict:
            missing = [p for p in self.info.parameters if p not in loaded]
            if missing:
                raise UserError(f"no value for parameter '{missing[0]}' ({len(missing)} of "
                                f"{len(self.info.parameters)} missing; load with strict=False to keep the rest)")
        self._fixed_values.update({name: value for name, value in loaded.items() if name not in carried})
        loaded_carried = {name: value for name, value in loaded.items() if name in carried}
        if loaded_carried:
            current = {name: value for name, value in self.state_dict().items() if name in carried} if self._ran else {}
            self._pending = {**current, **self._pending, **loaded_carried}
        return sorted(loaded)

    def load_weights(self, source: str | os.PathLike | Mapping[str, object], strict: bool = False) -> list[str]:
        """Load weights before training: from an ONNX model (its initializers by name), a
        safetensors file, or a mapping such as a PyTorch `state_dict` (names as the exporter
        gave them). Frozen weights load too; optimizer states from a checkpoint are left out
        (a fine-tuning run starts its optimizer afresh; `load_checkpoint` resumes one). Names the
        step does not hold (and PyTorch's num_batches_tracked) are ignored; returns the names
        loaded. UserError where nothing matches."""
        if isinstance(source, Mapping):
            state = dict(source)
        else:
            state = _read_weights(Path(source))
        states = set(self.info.states)
        state = {name: value for name, value in state.items() if name not in states}
        known = set(self.info.carried) | set(self.fixed_weights)
        state = {name: value for name, value in state.items() if name in known}
        if not state:
            raise UserError("none of the given weights is a parameter or buffer of this step (names differ?)")
        return self.load_state_dict(state, strict=strict)

    # ---- checkpoints -------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, extra: Mapping[str, str] | None = None) -> Path:
        """Write the state, the step number and the hyperparameters to `path` (safetensors),
        atomically. `extra`: more string metadata (the CLI's epoch)."""
        from safetensors.numpy import save_file

        state = self.state_dict()
        metadata = {"format": CHECKPOINT_FORMAT, "step": str(self.step_count),
                    "optimizer": self.info.optimizer,
                    "hyperparameters": json.dumps(self.hyperparameters, sort_keys=True),
                    **{f"extra.{k}": str(v) for k, v in (extra or {}).items()}}
        return write_file_atomic(path, lambda tmp: save_file(state, tmp, metadata=metadata))

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, str]:
        """Resume from a checkpoint `save_checkpoint` wrote: every tensor, the step number and
        the hyperparameters; returns its extra metadata. UserError for another step's."""
        state, metadata = read_checkpoint(path)
        if metadata.get("optimizer") != self.info.optimizer:
            raise UserError(f"{path} is a checkpoint of a {metadata.get('optimizer')} step; this plan's "
                            f"optimizer is {self.info.optimizer}")
        missing = [name for name in self.info.carried if name not in state]
        if missing:
            raise UserError(f"{path} has no '{missing[0]}': it is a checkpoint of another model")
        self.load_state_dict(state)
        self.step_count = int(metadata["step"])
        self.hyperparameters.update(json.loads(metadata["hyperparameters"]))
        return {k[len("extra."):]: v for k, v in metadata.items() if k.startswith("extra.")}


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a memsched checkpoint; UserError where `path` is none."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such checkpoint: {path}")
    state, metadata = _read_safetensors(path)
    if metadata.get("format") != CHECKPOINT_FORMAT or "step" not in metadata:
        raise UserError(f"{path} is not a memsched checkpoint (no '{CHECKPOINT_FORMAT}' metadata)")
    return state, metadata


def _read_weights(path: Path) -> dict[str, np.ndarray]:
    """The tensors of an ONNX model or a safetensors file (a checkpoint's included), by name."""
    if not path.is_file():
        raise UserError(f"no such weights file: {path}")
    if path.suffix == ".safetensors":
        return _read_safetensors(path)[0]
    model = read_model(path)
    try:
        return {init.name: numpy_helper.to_array(init, base_dir=str(path.parent)) for init in model.graph.initializer}
    except (OSError, ValueError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:
        raise UserError(f"cannot read the weights of {path}: {str(exc).splitlines()[0]}") from None


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, read once; UserError where it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(f"{path} is not a readable safetensors file: {str(exc).splitlines()[0]}") from None


def _class_count(graph, info: StepInfo) -> int | None:
    """For a cross_entropy step, the number of classes its labels index (the class axis of the
    model's output: the last one for [N, C] and [N, L, V], axis 1 for maps), else None."""
    output = forward_output(graph)
    if info.loss != "cross_entropy" or output is None or graph.tensors.get(output) is None:
        return None
    shape = graph.tensors[output].shape
    return (shape[-1] if len(shape) <= 3 else shape[1]) if shape else None


def _as_array(value: object, name: str) -> np.ndarray:
    """`value` as a numpy array without a copy where numpy can view it (a CPU torch tensor
    included); a tensor that needs a gradient is detached first."""
    if hasattr(value, "detach") and hasattr(value, "requires_grad"):
        value = value.detach()
        if getattr(value, "is_cuda", False):
            value = value.cpu()
    try:
        return np.asarray(value)
    except Exception as exc:  # noqa: BLE001 - anything numpy cannot read
        raise UserError(f"'{name}' is not an array numpy can read ({type(value).__name__}): {exc}") from None
