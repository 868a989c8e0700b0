"""Hand-computed checks of the NumPy FP4 reference (python/bgraph_fp4/reference.py); CPU only."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from bgraph_fp4 import reference as ref  # noqa: E402

INF, NAN = np.float32(np.inf), np.float32(np.nan)
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def f32(*values) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def above(x: float) -> np.float32:
    return np.nextafter(np.float32(x), np.float32(np.inf))


def below(x: float) -> np.float32:
    return np.nextafter(np.float32(x), np.float32(-np.inf))


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


# ---- E2M1 ---------------------------------------------------------------------------


def test_e2m1_decodes_the_16_codes():
    expected = f32(*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES))
    np.testing.assert_array_equal(bits(ref.e2m1_decode(np.arange(16))), bits(expected))
    assert np.signbit(ref.e2m1_decode(np.uint8(8)))


def test_e2m1_encodes_each_value_to_its_code():
    values = f32(*E2M1_MAGNITUDES, *(-m for m in E2M1_MAGNITUDES))
    np.testing.assert_array_equal(ref.e2m1_encode(values), np.arange(16))


@pytest.mark.parametrize(
    "tie, code",
    [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6)],
)
def test_e2m1_ties_round_to_the_even_code(tie, code):
    assert ref.e2m1_encode(f32(tie, -tie)).tolist() == [code, code | 8]


@pytest.mark.parametrize(
    "x, code",
    [
        (above(0.25), 1), (below(0.75), 1), (above(1.25), 3), (below(1.75), 3),
        (above(2.5), 5), (below(3.5), 5), (above(5.0), 7), (below(0.25), 0),
    ],
)
def test_e2m1_rounds_to_nearest_off_ties(x, code):
    assert ref.e2m1_encode(f32(x)).tolist() == [code]


def test_e2m1_saturates_and_maps_nan_to_plus_six():
    x = f32(6.5, 7.0, 1e30, INF, -6.5, -INF, NAN, -NAN)
    assert ref.e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15, 7, 7]


def test_e2m1_keeps_the_sign_of_zero_and_of_underflow():
    tiny = np.float32(1e-45)  # smallest float32 subnormal
    x = f32(0.0, -0.0, tiny, -tiny, 0.2, -0.2)
    assert ref.e2m1_encode(x).tolist() == [0, 8, 0, 8, 0, 8]


# ---- E4M3 ---------------------------------------------------------------------------


def test_e4m3_max_and_saturation():
    assert ref.e4m3_decode(np.uint8(0x7E)) == 448.0
    x = f32(448.0, 464.0, above(464.0), 1e9, INF, -INF, -1e9)
    assert ref.e4m3_encode(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]


def test_e4m3_rounds_to_nearest_even():
    # Between 1 (0x38) and 1.125 (0x39); between 1.125 and 1.25 (0x3A).
    x = f32(1.0625, above(1.0625), 1.1875, 432.0)
    assert ref.e4m3_encode(x).tolist() == [0x38, 0x39, 0x3A, 0x7E]


def test_e4m3_subnormals():
    ulp = 2.0**-9
    assert ref.e4m3_decode(np.arange(8, dtype=np.uint8)).tolist() == [k * ulp for k in range(8)]
    assert ref.e4m3_decode(np.uint8(0x08)) == 2.0**-6  # smallest normal
    x = f32(ulp / 2, above(ulp / 2), 1.5 * ulp, 2.5 * ulp, 7.5 * ulp, -ulp)
    assert ref.e4m3_encode(x).tolist() == [0x00, 0x01, 0x02, 0x02, 0x08, 0x81]


def test_e4m3_nan_codes():
    assert np.isnan(ref.e4m3_decode(np.array([0x7F, 0xFF], dtype=np.uint8))).all()
    assert ref.e4m3_encode(f32(NAN, -NAN)).tolist() == [0x7F, 0x7F]


def test_e4m3_every_finite_code_round_trips():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(ref.e4m3_encode(ref.e4m3_decode(codes)), codes)


def test_e4m3_decode_known_values():
    assert ref.e4m3_decode(np.array([0x38, 0x40, 0xB8, 0x80], dtype=np.uint8)).tolist() == [
        1.0, 2.0, -1.0, -0.0,
    ]


# ---- packing and NVFP4 --------------------------------------------------------------


def test_pack_puts_even_elements_in_the_low_nibble():
    assert ref.pack(np.array([1, 2, 3], dtype=np.uint8)).tolist() == [0x21, 0x03]
    assert ref.unpack(np.array([0x21, 0x03], dtype=np.uint8), 3).tolist() == [1, 2, 3]


def test_convert_packs_plain_e2m1():
    assert ref.convert(f32(1.0, -6.0, 0.5)).tolist() == [0xF2, 0x01]


def test_block_amax_ignores_nan():
    x = np.zeros(32, dtype=np.float32)
    x[3], x[5], x[20:] = -5.0, NAN, NAN
    assert ref.block_amax(x).tolist() == [5.0, 0.0]


def test_quantize_block_scaled_by_two():
    # amax 12 -> scale e4m3(12 / 6) = 2.0 (0x40); codes are those of x / 2.
    x = f32(12.0, -1.0, 0.5, 1.5, 2.5, 3.0, 0.0, -0.0, 5.0, 7.0, 9.0, 10.0, -12.0, 1.0, 4.0, 6.0)
    codes, scales = ref.quantize(x, 1.0)
    assert scales.tolist() == [0x40]
    # x / 2: 6, -0.5, 0.25 (tie -> 0), 0.75 (tie -> 1.0), 1.25 (tie -> 1.0), 1.5, 0, -0,
    #        2.5 (tie -> 2), 3.5 (tie -> 4), 4.5, 5 (tie -> 4), -6, 0.5, 2, 3
    expected = [7, 9, 0, 2, 2, 3, 0, 8, 4, 6, 6, 6, 15, 1, 4, 5]
    assert ref.unpack(codes, 16).tolist() == expected
    np.testing.assert_array_equal(
        ref.dequantize(codes, scales, 1.0, 16), 2 * ref.e2m1_decode(np.array(expected))
    )


def test_quantize_zero_block_gives_zero_scale_and_positive_zero_codes():
    x = np.zeros(16, dtype=np.float32)
    x[1::2] = -0.0
    codes, scales = ref.quantize(x, 0.5)
    assert scales.tolist() == [0] and codes.tolist() == [0] * 8


def test_quantize_with_global_scale():
    # amax 6 with g = 1/64 -> scale e4m3(64) = 0x68, d = 64 * g = 1.
    g = np.float32(1 / 64)
    x = np.full(16, 6.0, dtype=np.float32)
    codes, scales = ref.quantize(x, g)
    assert scales.tolist() == [0x68] and codes.tolist() == [0x77] * 8
    np.testing.assert_array_equal(ref.dequantize(codes, scales, g, 16), x)


def test_quantize_infinite_element_saturates_scale():
    x = np.ones(16, dtype=np.float32)
    x[0] = -INF
    codes, scales = ref.quantize(x, 1.0)
    assert scales.tolist() == [0x7E]
    # d = 448: -inf -> -6, 1 / 448 -> 0.
    assert ref.unpack(codes, 16).tolist() == [15] + [0] * 15


def test_quantize_rejects_partial_blocks():
    with pytest.raises(ValueError):
        ref.quantize(np.zeros(17, dtype=np.float32), 1.0)
