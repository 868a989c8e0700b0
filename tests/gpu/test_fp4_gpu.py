"""libbgraph_fp4 on a real GPU against the exact NumPy reference.

Needs an NVIDIA GPU (nvidia-smi must work) and BGRAPH_FP4_LIB pointing at the built
libbgraph_fp4.so; skipped otherwise. Codes and scales must match bit for bit, and
dequantized floats exactly (NaNs only need to be NaN on both sides).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

import bgraph_fp4 as fp4  # noqa: E402
from bgraph_fp4 import reference as ref  # noqa: E402


def _gpu_compute_capability() -> float | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.split()
    return float(lines[0]) if lines else None


def _library_under_test() -> str | None:
    """$BGRAPH_FP4_LIB as pytest was started with it. tests/conftest.py drops every BGRAPH_*
    variable from the session (bgraph's own settings must not reach the tests), this one too,
    so it is read back from the environment the process was started with."""
    if os.environ.get(fp4.LIB_ENV):
        return os.environ[fp4.LIB_ENV]
    try:
        started_with = Path("/proc/self/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = fp4.LIB_ENV.encode() + b"="
    return next((v[len(prefix):].decode() for v in started_with if v.startswith(prefix) and v != prefix), None)


COMPUTE_CAPABILITY = _gpu_compute_capability()
LIBRARY = _library_under_test()
# The symbols of the C ABI (kernels/fp4/bgraph_fp4.h) the Python front end binds.
SYMBOLS = ("bgraph_fp4_convert", "bgraph_fp4_quantize", "bgraph_fp4_dequantize", "bgraph_fp4_has_hw_cvt",
           "bgraph_fp4_last_error")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(COMPUTE_CAPABILITY is None, reason="no working NVIDIA GPU (nvidia-smi)"),
    pytest.mark.skipif(LIBRARY is None, reason=f"{fp4.LIB_ENV} is not set (the libbgraph_fp4.so to test)"),
]


@pytest.fixture(scope="module", autouse=True)
def library_under_test():
    """$BGRAPH_FP4_LIB for this module's tests only (the session's environment has no BGRAPH_*)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(fp4.LIB_ENV, LIBRARY)
        yield Path(LIBRARY)

SEEDS = [0, 1, 2]
GLOBAL_SCALES = [1.0, 1 / (6 * 448), 3e-3, 37.5, 2.0**-100, 1e-44]  # 1e-44: subnormal
SPECIALS = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1e-39, 6.0, 7.5, -1e30]


def assert_same_floats(actual, expected):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert actual.shape == expected.shape
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual), nan)
    np.testing.assert_array_equal(actual.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def check_quantize(x, global_scale):
    """Quantize and dequantize on the GPU; both must equal the reference exactly."""
    x = np.asarray(x, np.float32)
    codes, scales = fp4.quantize(x, global_scale)
    ref_codes, ref_scales = ref.quantize(x, global_scale)
    np.testing.assert_array_equal(scales, ref_scales)
    np.testing.assert_array_equal(codes, ref_codes)
    assert_same_floats(
        fp4.dequantize(codes, scales, global_scale, x.size),
        ref.dequantize(ref_codes, ref_scales, global_scale, x.size),
    )


def random_data(seed: int, n: int) -> np.ndarray:
    """Signed values whose magnitudes span float32 subnormals to ~1e6, varying per block."""
    rng = np.random.default_rng(seed)
    block_magnitude = 10.0 ** rng.uniform(-40, 6, size=(n // 16, 1))
    x = rng.standard_normal((n // 16, 16)) * block_magnitude
    return x.astype(np.float32).reshape(-1)


def tie_blocks(d: float) -> np.ndarray:
    """Blocks whose amax is 6 * d, holding every E2M1 midpoint times d (exact ties)."""
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    block = np.concatenate([ties, -ties]) * np.float32(d)
    return np.concatenate([block, block[::-1]]).astype(np.float32)


def test_library_loads(library_under_test):
    """The file named by $BGRAPH_FP4_LIB is the one loaded (dlopen, its dependencies resolved),
    it exports the C ABI, and its kernels run on this GPU."""
    assert fp4.library_path() == library_under_test
    lib = fp4._lib()  # ctypes.CDLL: raises OSError for a file that is not a loadable library
    assert Path(lib._name) == library_under_test
    for name in SYMBOLS:
        assert callable(getattr(lib, name)), name
    mapped = {line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
              if line.count(" ") >= 5}
    assert str(library_under_test.resolve()) in mapped
    # E2M1 of 0, 0.5, 6, -6 is 0x0, 0x1, 0x7, 0xF, two per byte with the even element low.
    assert fp4.convert(np.array([0.0, 0.5, 6.0, -6.0], np.float32)).tolist() == [0x10, 0xF7]


def test_hw_cvt_flag_matches_the_gpu():
    """The flag names the E2M1 path of the cubin the runtime picked for this GPU: the library's
    targets build arch-specific cubins, with the hardware cvt.rn.satfinite.e2m1x2 from sm_100 on
    (12.0a, 12.1a: //kernels:fp4) and the software path below (9.0a: //kernels:fp4-sm90)."""
    hw = fp4.has_hw_cvt()
    assert type(hw) is bool
    assert hw is (COMPUTE_CAPABILITY >= 10.0), (COMPUTE_CAPABILITY, hw)
    assert fp4.has_hw_cvt() is hw  # a property of the loaded cubin: asked again, the same


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("global_scale", GLOBAL_SCALES)
def test_quantize_random(seed, global_scale):
    check_quantize(random_data(seed, 16 * 4099), global_scale)


@pytest.mark.parametrize("seed", SEEDS)
def test_quantize_with_the_usual_global_scale(seed):
    x = random_data(seed, 16 * 1024)
    global_scale = float(np.float32(np.abs(x).max() / (6 * 448)))
    check_quantize(x, global_scale)


@pytest.mark.parametrize("d", [1.0, 2.0, 0.375, 2.0**-9])
def test_quantize_exact_ties(d):
    check_quantize(tie_blocks(d), 1.0)


def test_quantize_special_values():
    rng = np.random.default_rng(7)
    blocks = [
        np.zeros(16),                                # all-zero block
        np.full(16, -0.0),                           # all negative zero
        np.full(16, np.nan),                         # all NaN: amax 0
        np.resize(SPECIALS, 16),                     # inf, NaN, zeros, subnormals, saturation
        np.full(16, 1e-45),                          # smallest subnormal everywhere
        rng.standard_normal(16) * 1e-42,             # subnormal block
        np.where(rng.random(16) < 0.5, 1e30, -7.0),  # values far above 6 * scale
        rng.standard_normal(16) * 500,               # scale above 448 saturates
    ]
    x = np.concatenate(blocks).astype(np.float32)
    for global_scale in GLOBAL_SCALES:
        check_quantize(x, global_scale)


@pytest.mark.parametrize("n", [16, 32, 48])
def test_quantize_tiny_inputs(n):
    check_quantize(random_data(3, n), 0.25)


def test_quantize_empty():
    codes, scales = fp4.quantize(np.zeros(0, np.float32), 1.0)
    assert codes.size == 0 and scales.size == 0


def test_quantize_beyond_one_grid_pass():
    # More 16-element blocks than the launch grid has threads (4096 * 256).
    check_quantize(random_data(11, 16 * (4096 * 256 + 300)), 1e-2)


def test_dequantize_every_scale_byte():
    rng = np.random.default_rng(5)
    n = 16 * 256
    codes = rng.integers(0, 256, n // 2, dtype=np.uint8)
    scales = np.arange(256, dtype=np.uint8)  # includes the NaN scales 0x7F and 0xFF
    for global_scale in GLOBAL_SCALES:
        assert_same_floats(
            fp4.dequantize(codes, scales, global_scale, n),
            ref.dequantize(codes, scales, global_scale, n),
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_convert_random_bit_patterns(seed):
    # Every kind of float32: NaNs with payloads, infinities, subnormals, huge values.
    patterns = np.random.default_rng(seed).integers(0, 2**32, 1 << 22, dtype=np.uint64)
    x = patterns.astype(np.uint32).view(np.float32)
    np.testing.assert_array_equal(fp4.convert(x), ref.convert(x))


def test_convert_ties_specials_and_odd_length():
    x = np.concatenate([tie_blocks(1.0), np.array(SPECIALS), [1.75]]).astype(np.float32)
    assert x.size % 2 == 1
    np.testing.assert_array_equal(fp4.convert(x), ref.convert(x))


def test_convert_around_every_threshold():
    thresholds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], np.float32)
    steps = np.arange(-64, 65, dtype=np.int64)  # ulps either side
    around = (thresholds.view(np.uint32)[:, None].astype(np.int64) + steps).astype(np.uint32)
    x = around.view(np.float32).reshape(-1)
    x = np.concatenate([x, -x])
    np.testing.assert_array_equal(fp4.convert(x), ref.convert(x))


@pytest.mark.parametrize("global_scale", [0.0, -1.0, np.inf, np.nan, 1e38])
def test_invalid_global_scale_is_rejected(global_scale):
    with pytest.raises(fp4.Fp4Error, match="global_scale"):
        fp4.quantize(np.ones(16, np.float32), global_scale)


def test_partial_block_is_rejected():
    with pytest.raises(ValueError):
        fp4.quantize(np.ones(24, np.float32), 1.0)
