"""Relabel the element dtype of a DLPack capsule in place (the uint8 transport for 1-byte dtypes).

Why: a 1-byte float (float8_e4m3fn, float8_e8m0fnu, ...) and uint8 have the same bytes and the same
itemsize, so a library that cannot export or import the float8 DLPack code can still share the
memory zero-copy: the producer exports the bytes, the capsule's ``DLDataType`` is rewritten before
the consumer opens it, and the consumer sees the dtype it supports. Only ``code`` changes
(``bits`` stays 8, ``lanes`` 1); data pointer, shape, strides and the deleter are untouched, so
ownership is exactly that of the original capsule.

The struct offsets are those of DLPack (``dlpack.h``, stable since v0.2 for ``DLTensor``):
``DLTensor = {void* data; DLDevice device (2 x int32); int32 ndim; DLDataType dtype; ...}``, so the
dtype starts at byte 20 of a ``DLTensor`` on every 64-bit platform. A legacy capsule
(``"dltensor"``) points at ``DLManagedTensor``, whose first member is the ``DLTensor``; a versioned
capsule (``"dltensor_versioned"``) points at ``DLManagedTensorVersioned``, whose ``DLTensor`` starts
at byte 32 (after version, manager_ctx, deleter, flags).
"""

from __future__ import annotations

import ctypes
import enum
from typing import NamedTuple

__all__ = ["DLDataTypeCode", "DLDataType", "read_dtype", "relabel"]

_DTYPE_OFFSET_IN_DLTENSOR = 20
_DLTENSOR_OFFSET = {b"dltensor": 0, b"dltensor_versioned": 32}

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class DLDataTypeCode(enum.IntEnum):
    """``DLDataTypeCode`` values of DLPack 1.1 that the bridge uses."""

    INT = 0
    UINT = 1
    FLOAT = 2
    BFLOAT = 4
    BOOL = 6
    FLOAT8_E4M3FN = 10
    FLOAT8_E5M2 = 12
    FLOAT8_E8M0FNU = 14


class DLDataType(NamedTuple):
    code: int
    bits: int
    lanes: int


class _DLDataTypeStruct(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


# A DLPack capsule is a PyCapsule (``types.CapsuleType`` from Python 3.13): typed ``object``.


def _dtype_struct(capsule: object) -> _DLDataTypeStruct:
    name = _get_name(capsule)
    if name not in _DLTENSOR_OFFSET:
        raise ValueError(
            f"bridge.capsule: expected an unconsumed DLPack capsule named 'dltensor' or "
            f"'dltensor_versioned', got one named {name!r} (a consumed capsule is renamed "
            f"'used_dltensor'); pass a fresh capsule from __dlpack__()"
        )
    base = _get_pointer(capsule, name)
    addr = base + _DLTENSOR_OFFSET[name] + _DTYPE_OFFSET_IN_DLTENSOR
    return _DLDataTypeStruct.from_address(addr)


def read_dtype(capsule: object) -> DLDataType:
    """The ``DLDataType`` recorded in an unconsumed DLPack capsule."""
    s = _dtype_struct(capsule)
    return DLDataType(int(s.code), int(s.bits), int(s.lanes))


def relabel(capsule: object, code: DLDataTypeCode) -> None:
    """Rewrite the dtype code of an unconsumed capsule holding 8-bit, 1-lane elements.

    Raises ``ValueError`` if the capsule's elements are not 8-bit scalars: relabeling is only
    byte-exact between dtypes of the same itemsize, and the bridge only needs 1-byte ones.
    """
    s = _dtype_struct(capsule)
    if s.bits != 8 or s.lanes != 1:
        raise ValueError(
            f"bridge.capsule.relabel: only 8-bit, 1-lane elements can be relabeled, the capsule "
            f"holds code={s.code} bits={s.bits} lanes={s.lanes}"
        )
    s.code = int(code)
