"""Small ONNX helpers shared by the core and by models/: pinned versions, atomic saves.

onnx 1.23 writes IR 14 / opset 28 by default, which onnxruntime 1.31 rejects; everything
memsched builds is pinned to OPSET / IR_VERSION below.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import onnx
from onnx import helper

OPSET = 17          # what torch.onnx.export writes by default; LayerNormalization exists
IR_VERSION = 8      # accepted by every onnxruntime >= 1.14
MEMSCHED_DOMAIN = "ai.memsched"
TWO_GB = 2**31


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

    Models past 2 GB are written with their initializers in one external-data file beside it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    big = model.ByteSize() >= TWO_GB if _size_known(model) else True
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    data_name = path.name + ".data"
    tmp_data = path.parent / f".{data_name}.tmp"
    try:
        if big:
            onnx.save_model(model, tmp, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
            # external data references the temp name; point it at the final one.
            _rename_external_location(tmp, tmp_data.name, data_name)
            os.replace(tmp_data, path.parent / data_name)
        else:
            onnx.save_model(model, tmp)
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, tmp_data):
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` via a temp file + rename (JSON reports, cost tables, profiles)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


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
