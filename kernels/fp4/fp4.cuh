// Shared constants, FP8 E4M3 scale helpers and kernel launchers of the bgraph FP4 library.
//
// NVFP4 recipe (every step is one correctly rounded float32 operation, so the NumPy
// reference in python/bgraph_fp4/reference.py reproduces it bit for bit):
//   amax  = max |x| over a block of 16 elements, NaNs ignored (0 for an all-NaN block)
//   scale = e4m3_rn_satfinite(amax / (6 * global_scale))     one byte per block
//   d     = float(scale) * global_scale
//   code  = d == 0 ? 0 : e2m1(x / d)                        two codes per byte, even element low
//   x'    = float(code) * d                                  dequantization
// global_scale must be > 0 with 6 * global_scale finite (the C API checks it), so the
// scale's input is never NaN: an infinite element gives scale 448 and code +-6.
// Build without --use_fast_math / -ftz=true: subnormal inputs and scales must survive.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "e2m1.cuh"

namespace bgraph_fp4 {

constexpr std::size_t kBlockElems = 16;         // elements sharing one E4M3 scale
constexpr float kE2M1Max = 6.0f;
constexpr int kThreadsPerBlock = 256;
constexpr std::size_t kMaxGridBlocks = 4096;    // grid-stride loops cover the rest

// Unroll depth of the grid-stride loops. Only device code reads it, so the host pass
// (where __CUDA_ARCH__ is undefined) can never disagree with a device pass.
#if __CUDA_ARCH__ == 1210
// sm_121 targets (GB10, DGX Spark): more loads in flight for LPDDR5x latency (untuned guess).
constexpr int kStrideUnroll = 4;
#else
constexpr int kStrideUnroll = 2;
#endif

// Grid size for `items` work items, one per thread, capped for grid-stride loops.
inline unsigned grid_for(std::size_t items) {
  const std::size_t blocks = (items + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned>(std::clamp<std::size_t>(blocks, 1, kMaxGridBlocks));
}

__device__ __forceinline__ std::size_t global_thread() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ std::size_t grid_threads() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ std::uint8_t e4m3_encode(float x) {
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
}

// Exact E4M3 decode: exponent re-biased 7 -> 127 for normals, m * 2^-9 for subnormals,
// 0x7F / 0xFF (the format's only NaNs) -> quiet NaN.
__host__ __device__ __forceinline__ float e4m3_decode(std::uint32_t code) {
  const std::uint32_t magnitude = code & 0x7Fu;
  const float value = magnitude < 8 ? static_cast<float>(magnitude) * 0x1p-9f
                                    : bits_float((magnitude << 20) + (120u << 23));
  const std::uint32_t bits = magnitude == 0x7Fu ? 0x7FC00000u : float_bits(value);
  return bits_float(((code & 0x80u) << 24) | bits);
}

// The per-block divisor d; _rn intrinsics keep it one IEEE multiply under any -fmad flag.
__device__ __forceinline__ float block_divisor(std::uint8_t scale, float global_scale) {
  return __fmul_rn(e4m3_decode(scale), global_scale);
}

// Launchers, one per translation unit. Device pointers, 16-byte aligned (cudaMalloc's
// are); n is a multiple of kBlockElems except for launch_convert. Each returns the
// launch status (cudaGetLastError), not the kernel's completion.
cudaError_t launch_convert(const float* x, std::size_t n, std::uint8_t* packed);
cudaError_t launch_block_amax(const float* x, std::size_t n, float* amax);
cudaError_t launch_block_scales(const float* amax, std::size_t blocks, float global_scale,
                                std::uint8_t* scales);
cudaError_t launch_quantize(const float* x, std::size_t n, const std::uint8_t* scales,
                            float global_scale, std::uint8_t* codes);
cudaError_t launch_dequantize(const std::uint8_t* codes, const std::uint8_t* scales,
                              std::size_t n, float global_scale, float* out);
cudaError_t launch_probe_hw_cvt(int* flag);

}  // namespace bgraph_fp4
