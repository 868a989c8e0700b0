"""NumPy front end of libbgraph_fp4, the project's CUDA NVFP4 kernels (kernels/fp4).

The shared library is found through ``$BGRAPH_FP4_LIB`` if set, else as
``libbgraph_fp4.so`` inside this package's directory or beside it. It is loaded on
first use, so ``bgraph_fp4.reference`` works on machines without it or a GPU.

``global_scale`` is passed to the library as float32. See ``reference`` for the exact
recipe and the rounding, saturation and NaN rules.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import numpy as np

BLOCK = 16
LIB_ENV = "BGRAPH_FP4_LIB"
LIB_NAME = "libbgraph_fp4.so"

__all__ = ["BLOCK", "Fp4Error", "convert", "dequantize", "has_hw_cvt", "library_path", "quantize"]


class Fp4Error(RuntimeError):
    """A libbgraph_fp4 call failed; the message is the library's."""


def library_path() -> Path:
    """Where the shared library is taken from."""
    if env := os.environ.get(LIB_ENV):
        return Path(env)
    package_dir = Path(__file__).resolve().parent
    for candidate in (package_dir / LIB_NAME, package_dir.parent / LIB_NAME):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{LIB_NAME} not found beside {package_dir}; set {LIB_ENV}")


def _array(dtype) -> type:
    return np.ctypeslib.ndpointer(dtype=dtype, flags="C_CONTIGUOUS")


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    size, f32 = ctypes.c_size_t, ctypes.c_float
    signatures = {
        "bgraph_fp4_convert": [_array(np.float32), size, _array(np.uint8)],
        "bgraph_fp4_quantize": [_array(np.float32), size, f32, _array(np.uint8), _array(np.uint8)],
        "bgraph_fp4_dequantize": [_array(np.uint8), _array(np.uint8), size, f32, _array(np.float32)],
        "bgraph_fp4_has_hw_cvt": [],
    }
    for name, argtypes in signatures.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.bgraph_fp4_last_error.argtypes = []
    lib.bgraph_fp4_last_error.restype = ctypes.c_char_p
    return lib


def _check(rc: int) -> None:
    if rc != 0:
        raise Fp4Error(f"libbgraph_fp4 error {rc}: {_lib().bgraph_fp4_last_error().decode()}")


def _flat_f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _check_blocked(n: int) -> None:
    if n % BLOCK:
        raise ValueError(f"length {n} is not a multiple of {BLOCK}")


def convert(x) -> np.ndarray:
    """E2M1 codes of ``x`` (no scaling), two per byte with the even element low."""
    x = _flat_f32(x)
    packed = np.empty((x.size + 1) // 2, dtype=np.uint8)
    _check(_lib().bgraph_fp4_convert(x, x.size, packed))
    return packed


def quantize(x, global_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 ``(codes, scales)`` of ``x``: n/2 packed code bytes and n/16 E4M3 scales."""
    x = _flat_f32(x)
    _check_blocked(x.size)
    codes = np.empty(x.size // 2, dtype=np.uint8)
    scales = np.empty(x.size // BLOCK, dtype=np.uint8)
    _check(_lib().bgraph_fp4_quantize(x, x.size, float(global_scale), codes, scales))
    return codes, scales


def dequantize(codes, scales, global_scale: float, n: int) -> np.ndarray:
    """The ``n`` float32 values that ``codes`` and ``scales`` encode."""
    _check_blocked(n)
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    scales = np.ascontiguousarray(scales, dtype=np.uint8).reshape(-1)
    if codes.size < n // 2 or scales.size < n // BLOCK:
        raise ValueError(f"{n} elements need {n // 2} code bytes and {n // BLOCK} scales")
    out = np.empty(n, dtype=np.float32)
    _check(_lib().bgraph_fp4_dequantize(codes, scales, n, float(global_scale), out))
    return out


def has_hw_cvt() -> bool:
    """Whether the current GPU runs the hardware E2M1 conversion (cvt...e2m1x2)."""
    flag = _lib().bgraph_fp4_has_hw_cvt()
    if flag < 0:
        _check(flag)
    return flag == 1
