"""Reading a large ONNX file without copying its weights into memory.

Planning never reads a weight's values, yet protobuf parses a model with every byte of them
(a 1.86 GB GPT-2: 10 s and 1.9 GB of memory here, then each copy of the graph copies them
again). `read` walks the file's wire format instead, three levels deep (model -> graph ->
initializer), and leaves each inline weight where it is: the tensor it gives back is
external data that names the model file itself, at the weight's offset. ONNX defines that
form, so everything that reads external data (the front end's checks, `Graph.to_onnx`,
`onnx_utils.save_model_atomic`, which copies such bytes into a plan's data file in chunks)
reads these weights with no special case. Only weights go this way (`onnx_utils.is_weight`:
float tensors past WEIGHT_BYTES, whose values never decide a shape); every other field is
copied as it is, and anything unusual in the file (a graph in several pieces, a group field,
a length past its end) falls back to `onnx.load`, which parses or refuses it as before.
"""
from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from . import dtypes
from .onnx_utils import SMALL_MODEL_BYTES, is_weight

# field numbers of onnx.proto
_MODEL_GRAPH = 7
_GRAPH_INITIALIZER = 5
_TENSOR_RAW_DATA = 9
_TENSOR_EXTERNAL_DATA = 13
_TENSOR_DATA_LOCATION = 14
_LENGTH_DELIMITED = 2


class _Unusual(Exception):
    """The file is not in the plain form `read` walks: onnx.load reads it instead."""


def read(path: str | os.PathLike) -> onnx.ModelProto:
    """The model at `path` (external data left on disk), its inline weights as external data
    in the file itself where the file is past SMALL_MODEL_BYTES (below it, onnx.load: small
    files gain nothing). onnx.load's errors reach the caller as they are."""
    path = Path(path)
    try:
        if path.is_file() and not path.is_symlink() and path.stat().st_size > SMALL_MODEL_BYTES:
            return _read_in_place(path)
    except (_Unusual, OSError, ValueError, DecodeError):
        pass
    return onnx.load(str(path), load_external_data=False)


def _read_in_place(path: Path) -> onnx.ModelProto:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        graphs = [field for field in _fields(data, 0, len(data)) if field[0] == _MODEL_GRAPH]
        if len(graphs) != 1 or graphs[0][1] != _LENGTH_DELIMITED:
            raise _Unusual("not one graph")
        _, _, graph_start, graph_end, graph_key = graphs[0]
        graph = bytearray()
        for number, wire, start, end, key in _fields(data, graph_start, graph_end):
            if number == _GRAPH_INITIALIZER and wire == _LENGTH_DELIMITED:
                tensor = _tensor_in_place(data, start, end, path.name)
                if tensor is not None:
                    graph += _length_delimited(_GRAPH_INITIALIZER, tensor)
                    continue
            graph += data[key:end]
        model = bytearray(data[:graph_key])
        model += _length_delimited(_MODEL_GRAPH, graph)
        model += data[graph_end:]
    return onnx.ModelProto.FromString(bytes(model))


def _tensor_in_place(data: mmap.mmap, start: int, end: int, location: str) -> bytes | None:
    """The TensorProto at data[start:end] with its raw_data replaced by a reference to the
    file at `location`, where it is a weight whose bytes match its dims; else None (kept as
    it is)."""
    raw = None
    header = bytearray()
    for number, wire, value_start, value_end, key in _fields(data, start, end):
        if number in (_TENSOR_EXTERNAL_DATA, _TENSOR_DATA_LOCATION):
            return None                              # already external
        if number == _TENSOR_RAW_DATA and wire == _LENGTH_DELIMITED:
            if raw is not None:
                return None                          # repeated: protobuf would keep the last
            raw = (value_start, value_end - value_start)
        else:
            header += data[key:value_end]
    if raw is None:
        return None
    tensor = TensorProto.FromString(bytes(header))
    itemsize = dtypes.itemsize(tensor.data_type) if is_weight(tensor) else 0
    if not itemsize or raw[1] != math.prod(tensor.dims) * itemsize:
        return None       # not a weight, or damaged: parsed as it is, the front end judges it
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(raw[0])), ("length", str(raw[1]))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor.SerializeToString()


def _fields(data, start: int, end: int):
    """(number, wire type, value start, value end, field start) of each field in data[start:end]."""
    position = start
    while position < end:
        key_start = position
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value_start = position
            _, position = _varint(data, position)
        elif wire == 1:
            value_start, position = position, position + 8
        elif wire == 5:
            value_start, position = position, position + 4
        elif wire == _LENGTH_DELIMITED:
            length, value_start = _varint(data, position)
            position = value_start + length
        else:
            raise _Unusual(f"wire type {wire}")
        if position > end or number == 0:
            raise _Unusual("a field past its message")
        yield number, wire, value_start, position, key_start


def _varint(data, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 63:
            raise _Unusual("a broken varint")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def _length_delimited(number: int, payload: bytes | bytearray) -> bytes:
    return _encode_varint(number << 3 | _LENGTH_DELIMITED) + _encode_varint(len(payload)) + bytes(payload)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
