"""Small ONNX helpers shared by the core and by models/: pinned versions, atomic saves, the
weight-free view ONNX's checker and shape inference are given.

onnx 1.23 writes IR 14 / opset 28 by default, which onnxruntime 1.31 rejects; everything
memsched builds is pinned to OPSET / IR_VERSION below.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
from pathlib import Path
from typing import Callable

import onnx
from onnx import TensorProto, external_data_helper, helper

from . import dtypes
from .errors import UserError
from .outputs import check_writable, finish_mode, temp_path, unlink_quietly

OPSET = 17          # what torch.onnx.export writes by default; LayerNormalization exists
IR_VERSION = 8      # accepted by every onnxruntime >= 1.14
MEMSCHED_DOMAIN = "ai.memsched"
TWO_GB = 2**31
# A model that may serialize past this is written with its weights in a data file beside it:
# protobuf serializes a large message slowly (GPT-2's 1.87 GB took 18 s here, written as data
# 1.1 s) and one past 2 GB not at all.
INLINE_BYTES = 256 * 2**20
SMALL_MODEL_BYTES = 64 * 2**20   # a model file past this holds its weights inline: no data file to clean up


# A floating-point initializer larger than this is a weight: its values never decide a shape.
WEIGHT_BYTES = 1024


def checkable_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """What ONNX's shape inference and checker are given: `model` without the values of its
    weights (`is_weight`) and of its data-less initializers, each turned into a typed graph
    input. Both serialize the model they are given: with its weights, a GPT-2 of 1.8 GB took
    30 s and 9.9 GB of memory to load (3.8 s and 3.8 GB without: `bench/bench_load.py`), and
    the checker 13.6 s more to write its plan. Data-less ones: the
    checker would look for external files relative to the working directory, and
    header-only ones (shape-only graphs built for planning) have no data at all. Integer
    initializers (shapes, axes) stay, for data propagation. The model itself where nothing
    is left out."""
    graph = model.graph
    left_out = [i for i in graph.initializer if is_weight(i) or has_no_data(i)]
    if not left_out:
        return model
    names = {i.name for i in left_out}
    view = onnx.ModelProto(ir_version=model.ir_version)
    view.opset_import.extend(model.opset_import)
    view.functions.extend(model.functions)
    view.graph.name = graph.name
    view.graph.node.extend(graph.node)
    view.graph.input.extend(graph.input)
    view.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in left_out)
    view.graph.output.extend(graph.output)
    view.graph.value_info.extend(graph.value_info)
    view.graph.initializer.extend(i for i in graph.initializer if i.name not in names)
    view.graph.sparse_initializer.extend(graph.sparse_initializer)
    return view


def is_weight(init: TensorProto) -> bool:
    """A floating-point initializer over WEIGHT_BYTES by its dims (its values never decide a
    shape; a message's ByteSize would encode it to count)."""
    return dtypes.is_float(init.data_type) and math.prod(init.dims) * dtypes.itemsize(init.data_type) > WEIGHT_BYTES


def has_no_data(init: TensorProto) -> bool:
    """An initializer whose values are in an external file, or nowhere (a header only)."""
    if init.data_location == TensorProto.EXTERNAL:
        return True
    return not init.raw_data and not any(len(getattr(init, f)) for f in (
        "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data"))


def make_model(graph: onnx.GraphProto, opset: int = OPSET, ir_version: int = IR_VERSION,
               extra_domains: dict[str, int] | None = None, **kwargs) -> onnx.ModelProto:
    """onnx.helper.make_model with a pinned opset and IR version."""
    imports = [helper.make_opsetid("", opset)]
    for domain, version in (extra_domains or {}).items():
        imports.append(helper.make_opsetid(domain, version))
    model = helper.make_model(graph, opset_imports=imports, producer_name="memsched", **kwargs)
    model.ir_version = ir_version
    return model


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike, source_dir: str | None = None) -> Path:
    """Write `model` to `path` via a temp file + rename, so a failure leaves nothing half-written.

    Models past INLINE_BYTES are written with their initializers in one external-data file beside it,
    named `<output name>.<random>.data` so that every model file names its own data file:
    two writers to the same path each rename a complete pair and the model that wins the last
    rename points at its own data. The data file of the model that was replaced is removed.
    Temporaries carry `memsched.outputs.TEMP_TAG` so a later write cleans up after a killed one.
    Tensors whose data is still in another model's files (relative to `source_dir`, which the
    front end has checked they stay in) have their bytes copied into that data file in
    chunks, never all in memory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_writable(path)
    borrowed = source_dir is not None and any(t.data_location == TensorProto.EXTERNAL
                                              for t in external_data_helper._get_all_tensors(model))
    big = borrowed or _past_inline_limit(model)
    previous = _external_files(path)
    tmp = temp_path(path)
    data_name = f"{path.name}.{secrets.token_hex(4)}.data"
    tmp_data = None
    try:
        if big:
            tmp_data = temp_path(path, data_name)
            # onnx refuses a data file that exists, looked up from the working directory: from
            # the output's folder it would find the empty temporary just made (it appends)
            unlink_quietly(tmp_data)
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=os.path.basename(tmp_data), size_threshold=1024)
            written = os.path.exists(tmp_data) and os.path.getsize(tmp_data) > 0
            if not (written or borrowed):      # every tensor under the threshold: no data file
                unlink_quietly(tmp_data)
                tmp_data = None
            else:
                _own_external_data(tmp, tmp_data, data_name, source_dir if borrowed else None)
                finish_mode(tmp_data)
                os.replace(tmp_data, path.parent / data_name)
                tmp_data = path.parent / data_name      # if the model's rename fails, its data goes too
        else:
            onnx.save_model(model, tmp)
        finish_mode(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        unlink_quietly(tmp, *([tmp_data] if tmp_data is not None else []))
        if isinstance(exc, OSError):
            raise write_error(path, exc) from None
        raise
    unlink_quietly(*(path.parent / name for name in previous if name != data_name))
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` via a temp file + rename (JSON reports, cost tables, profiles)."""
    return write_file_atomic(path, _text_writer(text))


def staged_text(path: str | os.PathLike | None, text: str):
    """`staged_file` for `text`; `path` None: a block that writes nothing."""
    return contextlib.nullcontext() if path is None else staged_file(path, _text_writer(text))


def _text_writer(text: str) -> Callable[[str], None]:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)
    return write


def write_file_atomic(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Have `write(tmp)` write a temporary beside `path`, then rename it to `path`; a failure
    or a signal leaves nothing half-written (checkpoints, texts)."""
    with staged_file(path, write) as written:
        pass
    return written


@contextlib.contextmanager
def staged_file(path: str | os.PathLike, write: Callable[[str], None]):
    """Have `write(tmp)` write a temporary beside `path` now, and rename it to `path` when the
    block ends without an error. A failure of its own write is one line naming `path`
    (`write_error`); any failure, its own or the block's (another output of the command), or a
    signal removes the temporary: a command's outputs land together or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_writable(path)
    tmp = temp_path(path)
    try:
        try:
            write(tmp)
            finish_mode(tmp)
        except OSError as exc:
            raise write_error(path, exc) from None
        yield path
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise write_error(path, exc) from None
    except BaseException:
        unlink_quietly(tmp)
        raise


def write_error(path: str | os.PathLike, exc: OSError) -> UserError:
    """A failed write as one line naming the output (a full disk's ENOSPC names no file)."""
    return UserError(f"cannot write {path}: {exc.strerror or exc}")


def _external_files(path: Path) -> list[str]:
    """The data files (named as save_model_atomic names them) that the model now at `path` points at.

    Read before `path` is replaced so they can be removed after; anything else is left alone."""
    own = re.compile(re.escape(path.name) + r"\.[0-9a-f]{8}\.data")
    try:
        if not path.is_file() or path.stat().st_size > SMALL_MODEL_BYTES:
            return []
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # noqa: BLE001 - whatever is there is replaced anyway; nothing to clean up
        return []
    names = {entry.value for tensor in external_data_helper._get_all_tensors(model)
             for entry in tensor.external_data if entry.key == "location"}
    return sorted(name for name in names if own.fullmatch(name))


def _past_inline_limit(model: onnx.ModelProto) -> bool:
    """Whether `model` may serialize to INLINE_BYTES or more (`serialized_bound`)."""
    try:
        return serialized_bound(model) >= min(INLINE_BYTES, TWO_GB - 16 * 2**20)
    except Exception:  # noqa: BLE001 - protobuf refuses to size messages past 2 GB on some builds
        return True


def serialized_bound(model: onnx.ModelProto) -> int:
    """At least the bytes `model` serializes to, counted without encoding its weights
    (ByteSize encodes what it counts: 5 s for a 1.8 GB GPT-2): every tensor's stored bytes
    (10 a typed value, the most a varint takes) plus the size of the rest, the model's
    `checkable_view`. Tensors the view keeps count twice."""
    typed = ("float_data", "int32_data", "int64_data", "double_data", "uint64_data")
    stored = sum(len(t.raw_data) + 10 * sum(len(getattr(t, f)) for f in typed)
                 for t in external_data_helper._get_all_tensors(model))
    return stored + checkable_view(model).ByteSize()


COPY_CHUNK = 64 * 2**20


def _own_external_data(model_path: str, data_path: str, name: str, source_dir: str | None) -> None:
    """In the saved model at `model_path`, one pass over its tensors: those whose data onnx
    wrote to the temporary `data_path` name `name`, its final name, instead; with `source_dir`,
    those whose data lies in another model's files there have their bytes appended to
    `data_path`, COPY_CHUNK at a time, and name it too."""
    model = onnx.load(model_path, load_external_data=False)
    temporary = os.path.basename(data_path)
    with open(data_path, "ab") as out:
        for tensor in external_data_helper._get_all_tensors(model):
            if tensor.data_location != TensorProto.EXTERNAL:
                continue
            info = external_data_helper.ExternalDataInfo(tensor)
            if info.location == temporary:
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = name
                continue
            if source_dir is None:
                continue
            offset = out.tell()
            _append_range(out, os.path.join(source_dir, info.location), info.offset or 0, info.length, tensor.name)
            del tensor.external_data[:]        # (onnx's set_external_data wants the bytes in memory)
            for key, value in (("location", name), ("offset", offset), ("length", out.tell() - offset)):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, str(value)
    onnx.save_model(model, model_path)


def _append_range(out, path: str, start: int, length: int | None, tensor: str) -> None:
    """Append `length` bytes of the file at `path` from `start` (to its end where None) to
    `out`, COPY_CHUNK at a time."""
    with open(path, "rb") as source:
        source.seek(start)
        left = length if length is not None else os.fstat(source.fileno()).st_size - start
        while left > 0:
            chunk = source.read(min(COPY_CHUNK, left))
            if not chunk:
                raise OSError(f"{os.path.basename(path)} ends before tensor '{tensor}' does")
            out.write(chunk)
            left -= len(chunk)
