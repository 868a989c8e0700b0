// NVFP4 dequantization: packed codes and block scales back to float.
#include "fp4.cuh"

namespace bgraph_fp4 {
namespace {

// Two codes of one byte -> two floats, each one IEEE multiply by the block divisor.
__device__ __forceinline__ float2 dequantize_pair(std::uint32_t byte, float d) {
  return make_float2(__fmul_rn(e2m1_decode(byte & 0xFu), d),
                     __fmul_rn(e2m1_decode(byte >> 4 & 0xFu), d));
}

// One block per iteration: one 8-byte load of 16 codes, four float4 out.
__global__ void dequantize_kernel(const std::uint8_t* __restrict__ codes,
                                  const std::uint8_t* __restrict__ scales, std::size_t blocks,
                                  float global_scale, float* __restrict__ out) {
  const uint2* codes8 = reinterpret_cast<const uint2*>(codes);
  float4* out4 = reinterpret_cast<float4*>(out);
#pragma unroll kStrideUnroll
  for (std::size_t b = global_thread(); b < blocks; b += grid_threads()) {
    const float d = block_divisor(scales[b], global_scale);
    const uint2 packed = codes8[b];
    const std::uint32_t words[2] = {packed.x, packed.y};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::uint32_t half = words[q / 2] >> (16 * (q % 2));
      const float2 lo = dequantize_pair(half & 0xFFu, d);
      const float2 hi = dequantize_pair(half >> 8 & 0xFFu, d);
      out4[b * (kBlockElems / 4) + q] = make_float4(lo.x, lo.y, hi.x, hi.y);
    }
  }
}

}  // namespace

cudaError_t launch_dequantize(const std::uint8_t* codes, const std::uint8_t* scales,
                              std::size_t n, float global_scale, float* out) {
  const std::size_t blocks = n / kBlockElems;
  dequantize_kernel<<<grid_for(blocks), kThreadsPerBlock>>>(codes, scales, blocks, global_scale,
                                                           out);
  return cudaGetLastError();
}

}  // namespace bgraph_fp4
