// FP4 E2M1 encode/decode: float -> 4-bit code (sign | exponent:2 | mantissa:1) and back.
//
// Encoding policy, identical on the hardware and the software path:
//   * round to nearest, ties to even code (the code whose mantissa bit is 0);
//   * finite values beyond 6 and +-inf saturate to +-6 (code 0x7 / 0xF);
//   * the sign is kept for zeros and for values that round to zero (-0.1 -> 0x8);
//   * NaN, whatever its sign or payload, becomes +6 (code 0x7). CUDA documents this
//     for __nv_cvt_float_to_fp4, which is this instruction on the targets below and
//     an emulation elsewhere; the software path equals that emulation on all 2^32 floats.
// Magnitudes of the 8 codes: 0, 0.5, 1, 1.5, 2, 3, 4, 6.
#pragma once

#include <cstdint>
#include <cstring>

// cvt.rn.satfinite.e2m1x2.f32 exists on the arch- and family-specific targets from
// sm_100 on (100a/f, 103a, 110a/f, 120a/f, 121a/f). sm_90a also defines the *_SPECIFIC__
// macros, hence the __CUDA_ARCH__ bound; plain sm_120/sm_121 define neither.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 && \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) || defined(__CUDA_ARCH_SPECIFIC__))
#define BGRAPH_FP4_HW_E2M1 1
#else
#define BGRAPH_FP4_HW_E2M1 0
#endif

namespace bgraph_fp4 {

// True in the device pass of a target that converts with the hardware instruction.
constexpr bool kHwE2M1 = BGRAPH_FP4_HW_E2M1 != 0;

__host__ __device__ __forceinline__ std::uint32_t float_bits(float x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

__host__ __device__ __forceinline__ float bits_float(std::uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// Software encoder, branch-free: the magnitude code is the number of rounding
// thresholds |x| has passed. Each threshold is the midpoint of two neighbouring
// values; ">" where a tie belongs to the lower (even) code, ">=" where to the upper.
__host__ __device__ __forceinline__ std::uint32_t e2m1_encode_sw(float x) {
  const std::uint32_t bits = float_bits(x);
  const float a = bits_float(bits & 0x7FFFFFFFu);
  const std::uint32_t magnitude = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) +
                                  (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  // NaN fails every comparison above, so it is mapped to +6 explicitly.
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return is_nan ? 0x7u : ((bits >> 28) & 0x8u) | magnitude;
}

#if BGRAPH_FP4_HW_E2M1
// The instruction puts its first source in the high nibble, so `hi` goes first.
__device__ __forceinline__ std::uint32_t e2m1x2_encode_hw(float lo, float hi) {
  std::uint32_t packed;
  asm("{\n\t"
      ".reg .b8 pair;\n\t"
      "cvt.rn.satfinite.e2m1x2.f32 pair, %1, %2;\n\t"
      "cvt.u32.u8 %0, pair;\n\t"
      "}"
      : "=r"(packed)
      : "f"(hi), "f"(lo));
  return packed;
}
#endif

// Two floats -> one byte: `lo` in bits 0-3, `hi` in bits 4-7.
__host__ __device__ __forceinline__ std::uint8_t e2m1x2_encode(float lo, float hi) {
#if BGRAPH_FP4_HW_E2M1
  return static_cast<std::uint8_t>(e2m1x2_encode_hw(lo, hi));
#else
  return static_cast<std::uint8_t>(e2m1_encode_sw(lo) | (e2m1_encode_sw(hi) << 4));
#endif
}

// Exact decode of the low nibble of `code`. E2M1's exponent and mantissa bits line up
// with float32's once the exponent is re-biased (bias 1 -> 127, i.e. +126 << 23);
// code 1 is the only subnormal (0.5) and code 0 is zero.
__host__ __device__ __forceinline__ float e2m1_decode(std::uint32_t code) {
  const std::uint32_t magnitude = code & 0x7u;
  const std::uint32_t bits = magnitude < 2 ? magnitude * 0x3F000000u : (magnitude + 252u) << 22;
  return bits_float(((code & 0x8u) << 28) | bits);
}

}  // namespace bgraph_fp4
