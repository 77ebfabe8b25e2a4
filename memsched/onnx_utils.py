"""Small ONNX helpers shared by the core and by models/: pinned versions, atomic saves.

onnx 1.23 writes IR 14 / opset 28 by default, which onnxruntime 1.31 rejects; everything
memsched builds is pinned to OPSET / IR_VERSION below.
"""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

import onnx
from onnx import helper

from .outputs import check_writable, finish_mode, temp_path, unlink_quietly

OPSET = 17          # what torch.onnx.export writes by default; LayerNormalization exists
IR_VERSION = 8      # accepted by every onnxruntime >= 1.14
MEMSCHED_DOMAIN = "ai.memsched"
TWO_GB = 2**31
SMALL_MODEL_BYTES = 64 * 2**20   # a model file past this holds its weights inline: no data file to clean up


def make_model(graph: onnx.GraphProto, opset: int = OPSET, ir_version: int = IR_VERSION,
               extra_domains: dict[str, int] | None = None, **kwargs) -> onnx.ModelProto:
    """onnx.helper.make_model with a pinned opset and IR version."""
    imports = [helper.make_opsetid("", opset)]
    for domain, version in (extra_domains or {}).items():
        imports.append(helper.make_opsetid(domain, version))
    model = helper.make_model(graph, opset_imports=imports, producer_name="memsched", **kwargs)
    model.ir_version = ir_version
    return model


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> Path:
    """Write `model` to `path` via a temp file + rename, so a failure leaves nothing half-written.

    Models past 2 GB are written with their initializers in one external-data file beside it,
    named `<output name>.<random>.data` so that every model file names its own data file:
    two writers to the same path each rename a complete pair and the model that wins the last
    rename points at its own data. The data file of the model that was replaced is removed.
    Temporaries carry `memsched.outputs.TEMP_TAG` so a later write cleans up after a killed one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_writable(path)
    big = model.ByteSize() >= TWO_GB if _size_known(model) else True
    previous = _external_files(path)
    tmp = temp_path(path)
    data_name = f"{path.name}.{secrets.token_hex(4)}.data"
    tmp_data = None
    try:
        if big:
            tmp_data = temp_path(path, data_name)
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=os.path.basename(tmp_data), size_threshold=1024)
            # external data references the temp name; point it at the final one.
            if os.path.getsize(tmp_data) == 0:       # every tensor was under the threshold: no data file
                unlink_quietly(tmp_data)
                tmp_data = None
            else:
                _rename_external_location(tmp, os.path.basename(tmp_data), data_name)
                finish_mode(tmp_data)
                os.replace(tmp_data, path.parent / data_name)
                tmp_data = path.parent / data_name      # if the model's rename fails, its data goes too
        else:
            onnx.save_model(model, tmp)
        finish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp, *([tmp_data] if tmp_data is not None else []))
        raise
    unlink_quietly(*(path.parent / name for name in previous if name != data_name))
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` via a temp file + rename (JSON reports, cost tables, profiles)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_writable(path)
    tmp = temp_path(path)
    try:
        with open(tmp, "w") as f:
            f.write(text)
        finish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        unlink_quietly(tmp)
        raise
    return path


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
    names = {entry.value for tensor in onnx.external_data_helper._get_all_tensors(model)
             for entry in tensor.external_data if entry.key == "location"}
    return sorted(name for name in names if own.fullmatch(name))


def _size_known(model: onnx.ModelProto) -> bool:
    try:
        model.ByteSize()
        return True
    except Exception:  # protobuf refuses to size messages past 2 GB on some builds
        return False


def _rename_external_location(model_path: str, old: str, new: str) -> None:
    """Rewrite external_data 'location' entries from `old` to `new` in a saved model file."""
    model = onnx.load(model_path, load_external_data=False)
    for tensor in onnx.external_data_helper._get_all_tensors(model):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == old:
                entry.value = new
    onnx.save_model(model, model_path)
