"""ONNX element types: which are floating point, how many bytes an element takes, their
names. The one home of these facts for the core, the passes and the models."""
from __future__ import annotations

from functools import cache

import numpy as np
from onnx import TensorProto, helper

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)
HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def is_float(dtype: int) -> bool:
    return dtype in FLOAT_TYPES


@cache
def itemsize(dtype: int) -> int:
    """Bytes per element of an ONNX element type (asked about 100 times an op by the passes,
    hence cached); KeyError for a number that is no element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize


# element types packed below a byte in raw data: bits per element (numpy's itemsize says 1)
PACKED_BITS = {getattr(TensorProto, type_name): bits for type_name, bits in (
    ("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2)) if hasattr(TensorProto, type_name)}
UNFIXED_TYPES = {getattr(TensorProto, type_name) for type_name in ("STRING", "FLOAT6E2M3", "FLOAT6E3M2")
                 if hasattr(TensorProto, type_name)}     # strings; 6-bit floats may keep a padding byte


def stored_bytes(dtype: int, count: int) -> int | None:
    """The bytes `count` elements of `dtype` take in an initializer's raw data (2- and 4-bit
    types packed into bytes), or None where that is not fixed: strings, 6-bit floats, a number
    ONNX does not define."""
    if dtype in UNFIXED_TYPES:
        return None
    if dtype in PACKED_BITS:
        return -(-count * PACKED_BITS[dtype] // 8)
    try:
        return count * itemsize(dtype)
    except (KeyError, ValueError, TypeError):
        return None


def name(dtype: int) -> str:
    """'float32', 'int64', ...; 'bfloat16', which numpy lacks (onnx maps it to uint16)."""
    if dtype == TensorProto.BFLOAT16:
        return "bfloat16"
    return helper.tensor_dtype_to_np_dtype(dtype).name


def problem(dtype: int) -> str | None:
    """Why a tensor of element type `dtype` cannot be planned, or None where it can: a string
    has no fixed size, and 0 or a number ONNX does not define is no element type."""
    if dtype == TensorProto.STRING:
        return "holds strings; memsched plans numeric tensors only"
    try:
        itemsize(dtype)
    except (KeyError, ValueError, TypeError):
        return f"has element type {dtype}, which ONNX does not define"
    return None
