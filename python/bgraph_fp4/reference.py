"""Exact NumPy reference of the bgraph FP4 kernels (kernels/fp4).

Every function reproduces the CUDA code bit for bit:

* E2M1 encoding: round to nearest, ties to even; saturation to +-6 (inf included);
  the sign of zeros and of values rounding to zero is kept; NaN -> +6 (code 0x7).
* E4M3 encoding: round to nearest, ties to even, satfinite (+-448 for large values
  and inf); NaN of either sign -> 0x7F, as CUDA's __nv_cvt_float_to_fp8 (the
  quantizer never feeds it a NaN).
* NVFP4 quantization, per block of 16 elements, all arithmetic in float32::

      amax  = max |x| ignoring NaN (0 if there is none)
      scale = e4m3(amax / (6 * global_scale))
      d     = float(scale) * global_scale
      code  = 0 if d == 0 else e2m1(x / d)
      x'    = float(code) * d

Codes are packed two per byte, the even element in the low nibble.

The encoders here round in float64 with ``np.rint`` on exact power-of-two rescalings,
a different route from the threshold comparisons of the CUDA software path, so the
two check each other.
"""

from __future__ import annotations

import numpy as np

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0

# Magnitudes of the 8 non-negative E2M1 codes.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _as_f32(x) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).reshape(-1)


def _encode_magnitude(mag: np.ndarray, man_bits: int, emin: int, max_value: float) -> np.ndarray:
    """Exponent/mantissa bits of finite magnitudes ``mag`` (float64, >= 0), RNE, satfinite.

    ``emin`` is the exponent of the smallest normal; below it the quantum stays
    2**(emin - man_bits), which is what makes subnormals.
    """
    mag = np.minimum(mag, max_value)
    # frexp: mag = m * 2**e with m in [0.5, 1), so the leading bit's exponent is e - 1.
    exponent = np.maximum(np.frexp(mag)[1] - 1, emin)
    rounded = np.ldexp(np.rint(np.ldexp(mag, man_bits - exponent)), exponent - man_bits)
    # Rounding may carry into the next binade: recompute the exponent of the result.
    exponent = np.maximum(np.frexp(rounded)[1] - 1, emin)
    normal = rounded >= np.ldexp(1.0, emin)
    mantissa = np.ldexp(rounded, man_bits - exponent) - np.where(normal, 1 << man_bits, 0)
    exp_field = np.where(normal, exponent - emin + 1, 0)
    return (exp_field.astype(np.uint32) << man_bits) | mantissa.astype(np.uint32)


def _encode(x, man_bits: int, emin: int, max_value: float, sign_shift: int) -> tuple:
    x = _as_f32(x)
    nan = np.isnan(x)
    # NaNs are zeroed before widening: casting a signalling NaN raises "invalid".
    mag = np.abs(np.where(nan, np.float32(0), x)).astype(np.float64)
    code = _encode_magnitude(mag, man_bits, emin, max_value)
    sign = np.signbit(x).astype(np.uint32) << sign_shift
    return code | sign, nan


def e2m1_encode(x) -> np.ndarray:
    """One E2M1 code (0..15) per element of ``x``, as uint8."""
    code, nan = _encode(x, man_bits=1, emin=0, max_value=E2M1_MAX, sign_shift=3)
    return np.where(nan, 0x7, code).astype(np.uint8)


def e2m1_decode(codes) -> np.ndarray:
    """float32 value of each E2M1 code (low nibble of each uint8)."""
    codes = np.asarray(codes, dtype=np.uint8)
    mag = E2M1_VALUES[codes & 0x7]
    return np.where(codes & 0x8, -mag, mag).astype(np.float32)


def e4m3_encode(x) -> np.ndarray:
    """FP8 E4M3 code of each element of ``x``, RNE with satfinite, as uint8."""
    code, nan = _encode(x, man_bits=3, emin=-6, max_value=E4M3_MAX, sign_shift=7)
    return np.where(nan, 0x7F, code).astype(np.uint8)


def e4m3_decode(codes) -> np.ndarray:
    """float32 value of each E4M3 code; 0x7F and 0xFF decode to NaN."""
    codes = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    exp_field = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = exp_field > 0
    mag = np.where(
        normal,
        np.ldexp((8 + mantissa).astype(np.float64), exp_field - 10),
        np.ldexp(mantissa.astype(np.float64), -9),
    )
    mag = np.where((codes & 0x7F) == 0x7F, np.nan, mag)
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


def pack(codes) -> np.ndarray:
    """Packs 4-bit codes two per byte, even index low; an odd count pads with code 0."""
    codes = np.asarray(codes, dtype=np.uint8).reshape(-1)
    if codes.size % 2:
        codes = np.append(codes, np.uint8(0))
    return (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)


def unpack(packed, n: int) -> np.ndarray:
    """First ``n`` 4-bit codes of ``packed``."""
    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    return np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:n]


def convert(x) -> np.ndarray:
    """Plain E2M1 conversion of ``x``, packed: bgraph_fp4_convert."""
    return pack(e2m1_encode(x))


def _check_blocked(n: int) -> None:
    if n % BLOCK:
        raise ValueError(f"length {n} is not a multiple of {BLOCK}")


def block_amax(x) -> np.ndarray:
    """max |x| of each 16-element block, NaNs ignored, as float32."""
    x = _as_f32(x)
    _check_blocked(x.size)
    mag = np.abs(x.reshape(-1, BLOCK))
    return np.max(np.where(np.isnan(mag), np.float32(0), mag), axis=1, initial=np.float32(0))


def block_scales(x, global_scale) -> np.ndarray:
    """E4M3 scale byte of each 16-element block."""
    with np.errstate(over="ignore"):  # inf saturates to the largest scale, as on the GPU
        return e4m3_encode(block_amax(x) / (np.float32(E2M1_MAX) * np.float32(global_scale)))


def _divisors(scales, global_scale) -> np.ndarray:
    return e4m3_decode(scales) * np.float32(global_scale)


def quantize(x, global_scale) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes, scales) of ``x``: bgraph_fp4_quantize."""
    x = _as_f32(x)
    scales = block_scales(x, global_scale)
    d = _divisors(scales, global_scale)
    blocks = x.reshape(-1, BLOCK)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        codes = e2m1_encode(blocks / d[:, None]).reshape(blocks.shape)
    codes = np.where((d == 0)[:, None], np.uint8(0), codes)
    return pack(codes), scales


def dequantize(codes, scales, global_scale, n: int) -> np.ndarray:
    """float32 values of ``n`` quantized elements: bgraph_fp4_dequantize."""
    _check_blocked(n)
    d = _divisors(np.asarray(scales, dtype=np.uint8)[: n // BLOCK], global_scale)
    values = e2m1_decode(unpack(codes, n)).reshape(-1, BLOCK)
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        return (values * d[:, None]).reshape(-1)
