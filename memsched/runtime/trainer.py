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
file or a PyTorch `state_dict` before training (fine-tuning): by default every parameter and
buffer of the step and nothing else, as PyTorch's `load_state_dict(strict=True)`. Every field
of a checkpoint's metadata is checked as it is read (`read_checkpoint`): a step count that is
no whole number, hyperparameters that are not a JSON object of numbers, is one UserError naming
the file and the field, never a made-up position.
"""
from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..emit import read_plan
from ..errors import UserError, first_line
from .program import Hooks
from .run import PlanRunner
from ..frontend import read_model
from ..ir import tensor_value
from ..onnx_utils import write_file_atomic
from ..schedule import Plan
from ..step_info import OPTIMIZER_STATES, StepInfo, forward_output, step_info

CHECKPOINT_FORMAT = "memsched-checkpoint-1"
MAX_COUNT = 2 ** 63 - 1         # the largest step, epoch or batch number a checkpoint may hold
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
        loaded = self._checked_state(state)
        if strict:
            missing = [p for p in self.info.parameters if p not in loaded]
            if missing:
                raise UserError(f"no value for parameter {_quoted(missing[0])} ({len(missing)} of "
                                f"{len(self.info.parameters)} missing; load with strict=False to keep the rest)")
        return self._load(loaded)

    def _checked_state(self, state: Mapping[str, object]) -> dict[str, np.ndarray]:
        """`state` as copies in the step's dtypes, PyTorch's counters left out; a UserError for a
        name the step does not carry or hold fixed, another shape or another kind of dtype."""
        known = set(self.info.carried) | set(self.fixed_weights)
        loaded = {}
        for name, value in state.items():
            if name.rsplit(".", 1)[-1] in IGNORED_STATE:
                continue
            if name not in known:
                shown = ", ".join(self.info.parameters[:5]) + (", ..." if len(self.info.parameters) > 5 else "")
                raise UserError(f"{_quoted(name)} is no parameter, optimizer state or buffer of this step "
                                f"(its parameters: {shown})")
            t = self.graph.tensors[name]
            array = _as_array(value, name)
            if array.shape != tuple(t.shape):
                raise UserError(f"{_quoted(name)} has shape {array.shape}; the step's has {tuple(t.shape)}")
            dtype = helper.tensor_dtype_to_np_dtype(t.dtype)
            if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                raise UserError(f"{_quoted(name)} is {array.dtype}; the step's is {np.dtype(dtype)}")
            loaded[name] = np.array(array, dtype=dtype, order="C")     # a copy, 0-d kept 0-d
        return loaded

    def _load(self, loaded: dict[str, np.ndarray]) -> list[str]:
        """Make checked values (`_checked_state`) the next step's starting values; their names."""
        carried = set(self.info.carried)
        self._fixed_values.update({name: value for name, value in loaded.items() if name not in carried})
        loaded_carried = {name: value for name, value in loaded.items() if name in carried}
        if loaded_carried:
            current = {name: value for name, value in self.state_dict().items() if name in carried} if self._ran else {}
            self._pending = {**current, **self._pending, **loaded_carried}
        return sorted(loaded)

    def load_weights(self, source: str | os.PathLike | Mapping[str, object], strict: bool = True) -> list[str]:
        """Load weights before training: from an ONNX model (its initializers by name), a
        safetensors file, or a mapping such as a PyTorch `state_dict` (names as the exporter
        gave them); returns the names loaded. Frozen weights load too; optimizer states (of any
        optimizer, as a checkpoint holds them) are left out, since a fine-tuning run starts its
        optimizer afresh (`load_checkpoint` resumes one), and so are PyTorch's
        num_batches_tracked and the step's own constants (a plan's, a forward model's).
        With `strict` (as PyTorch's `load_state_dict`), every parameter and buffer of the step
        must be given and nothing else: a weights file of another model is one UserError naming
        what is missing and what is left over, never a run that keeps the plan's values
        unsaid. `strict=False` loads the ones that match. UserError where nothing matches."""
        where = "the given weights" if isinstance(source, Mapping) else f"the weights in {source}"
        state = dict(source) if isinstance(source, Mapping) else _read_weights(Path(source))
        weights = list(dict.fromkeys([*self.info.parameters, *self.info.buffers, *self.fixed_weights]))
        known = set(weights)
        state_names = {f"{w}.{s}" for w in self.info.parameters + self.fixed_weights
                       for states in OPTIMIZER_STATES.values() for s in states}
        constants = {name for name, t in self.graph.tensors.items() if t.is_static}
        left_out = [name for name in state if name not in known and (
            name in state_names or name.rsplit(".", 1)[-1] in IGNORED_STATE or name in constants)]
        state = {name: value for name, value in state.items() if name not in left_out}
        if not any(name in known for name in state):
            raise UserError(f"none of the given weights{'' if isinstance(source, Mapping) else f' ({source})'} "
                            f"is a parameter or buffer of this step (names differ?)")
        checked = self._checked_state({name: value for name, value in state.items() if name in known})
        if strict:
            missing = [name for name in weights if name not in checked]
            unexpected = [name for name in state if name not in known]
            if missing or unexpected:
                raise UserError(f"{where} are not this step's "
                                f"({_mismatch(missing, len(weights), unexpected)}); weights load by name, "
                                f"every parameter and buffer and nothing else")
        return self._load(checked)

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
        return write_file_atomic(path, lambda tmp: _safetensors_write(save_file, state, tmp, metadata))

    def load_checkpoint(self, path: str | os.PathLike) -> dict[str, str]:
        """Resume from a checkpoint `save_checkpoint` wrote: every tensor, the step number and
        the hyperparameters; returns its extra metadata. UserError for another step's, and for a
        metadata field that is not what `save_checkpoint` writes (`read_checkpoint`); nothing is
        loaded then."""
        state, metadata = read_checkpoint(path)
        if metadata["optimizer"] != self.info.optimizer:
            raise UserError(f"{path} is a checkpoint of a step with optimizer {metadata['optimizer']}; this plan's "
                            f"optimizer is {self.info.optimizer}")
        hyperparameters = json.loads(metadata["hyperparameters"])
        if set(hyperparameters) != set(self.info.hyperparameters):
            raise UserError(f"the checkpoint {path} holds hyperparameters {_names(sorted(hyperparameters))}; "
                            f"this step's are {_names(sorted(self.info.hyperparameters))}")
        missing = [name for name in [*self.info.carried, *self.fixed_weights] if name not in state]
        if missing:
            raise UserError(f"{path} has no {_quoted(missing[0])}: it is a checkpoint of another model")
        self.load_state_dict(state)
        self.step_count = int(metadata["step"])
        self.hyperparameters.update(hyperparameters)
        return {k[len("extra."):]: v for k, v in metadata.items() if k.startswith("extra.")}


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a memsched checkpoint, its metadata checked (`checkpoint_metadata`)."""
    metadata = checkpoint_metadata(path)
    return _read_safetensors(Path(path))[0], metadata


def checkpoint_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a memsched checkpoint, read without its tensors and checked field by
    field against what `save_checkpoint` writes: the format, the step (a whole number >= 0),
    the optimizer (one memsched knows) and the hyperparameters (a JSON object of finite numbers
    >= 0). A missing or bad field is one UserError naming the file and the field; `extra.*`
    fields are the writer's own (`train_loop` checks the ones `fit` writes)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"no such checkpoint: {path}")
    metadata = _read_safetensors(path, tensors=False)[1]
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a memsched checkpoint (no '{CHECKPOINT_FORMAT}' metadata)")
    for key in ("step", "optimizer", "hyperparameters"):
        if key not in metadata:
            raise UserError(f"the checkpoint {path} has no '{key}' in its metadata; it was not written by "
                            f"memsched (or was edited)")
    checkpoint_count(path, metadata, "step", "a step count")
    if metadata["optimizer"] not in OPTIMIZER_STATES:
        raise UserError(f"the checkpoint {path} holds optimizer {_shown(metadata['optimizer'])}; an optimizer is "
                        f"one of {', '.join(OPTIMIZER_STATES)}")
    try:
        hyperparameters = json.loads(metadata["hyperparameters"])
    except (ValueError, RecursionError):
        hyperparameters = None
    if not isinstance(hyperparameters, dict) or not all(_rate(v) for v in hyperparameters.values()):
        raise UserError(f"the checkpoint {path} holds hyperparameters {_shown(metadata['hyperparameters'])}; they "
                        f"are a JSON object of names to finite numbers >= 0")
    return metadata


def checkpoint_count(path: str | os.PathLike, metadata: Mapping[str, str], key: str, what: str,
                     least: int = 0, default: str | None = None) -> int:
    """Metadata field `key` of checkpoint `path` as a whole number from `least` up (to
    MAX_COUNT), `default` where it is absent; `what` names the count in the UserError, as in
    "the checkpoint ck.safetensors holds step '-1'; a step count is a whole number >= 0"."""
    text = metadata.get(key, default)
    if text is None:
        raise UserError(f"the checkpoint {path} has no '{key}' in its metadata; {what} is a whole number >= {least}")
    if re.fullmatch(r"[0-9]{1,19}", text) and least <= int(text) <= MAX_COUNT:
        return int(text)
    too_large = re.fullmatch(r"[0-9]+", text) and (len(text) > 19 or int(text) > MAX_COUNT)
    bound = f"from {least} to {MAX_COUNT}" if too_large else f">= {least}"
    raise UserError(f"the checkpoint {path} holds {key} {_shown(text)}; {what} is a whole number {bound}")


def _rate(value: object) -> bool:
    """Whether a JSON value is a hyperparameter's: a finite number >= 0 (not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value >= 0
    except OverflowError:                   # an integer too large for a float
        return False


def _shown(text: str, limit: int = 40) -> str:
    """`text` for a one-line message: quoted and escaped (a newline cannot split the line), cut
    after `limit` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _quoted(name: str) -> str:
    """A tensor name for a one-line message (`_shown`, longer names allowed)."""
    return _shown(name, 80)


def _names(names: list[str], limit: int = 3) -> str:
    """Up to `limit` names for a one-line message, then how many more."""
    shown = ", ".join(_quoted(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "") if names else "none"


def _mismatch(missing: list[str], total: int, unexpected: list[str]) -> str:
    """What a weights file lacks and what it holds besides the step's weights, in a few words."""
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} of the step's {total} parameters and buffers: {_names(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor{'s' if len(unexpected) > 1 else ''} the step does not have: "
                     f"{_names(unexpected)}")
    return "; ".join(parts)


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


def _read_safetensors(path: Path, tensors: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(tensors, metadata) of a safetensors file, read once (no tensors unless `tensors`);
    UserError where it is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            state = {name: f.get_tensor(name) for name in f.keys()} if tensors else {}
            return state, dict(f.metadata() or {})
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


def _safetensors_write(save_file, state: dict, tmp: str, metadata: dict[str, str]) -> None:
    """`save_file(state, tmp, metadata=...)`, its failure to write (a full disk: safetensors
    raises its own error, the OS's reason inside) an OSError with that reason, so the writer
    says it in one line and removes the temporary."""
    from safetensors import SafetensorError

    try:
        save_file(state, tmp, metadata=metadata)
    except SafetensorError as exc:
        reason = re.search(r'message: "([^"]+)"', str(exc))
        raise OSError(errno.EIO, reason.group(1) if reason else first_line(exc)) from None
