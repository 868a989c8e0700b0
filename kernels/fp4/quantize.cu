// NVFP4 quantization of a float array with precomputed block scales.
#include "fp4.cuh"

namespace bgraph_fp4 {
namespace {

// Encodes the 16 elements of one block; a zero divisor (zero scale, or an underflowed
// scale * global_scale) yields +0 codes instead of x / 0.
__device__ __forceinline__ uint2 quantize_block(const float4* block, float d) {
  std::uint32_t words[2] = {0u, 0u};
  if (d != 0.0f) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 v = block[q];
      const std::uint32_t lo = e2m1x2_encode(__fdiv_rn(v.x, d), __fdiv_rn(v.y, d));
      const std::uint32_t hi = e2m1x2_encode(__fdiv_rn(v.z, d), __fdiv_rn(v.w, d));
      words[q / 2] |= (lo | hi << 8) << (16 * (q % 2));
    }
  }
  return make_uint2(words[0], words[1]);
}

// One block per iteration: four float4 in, one 8-byte store of 16 codes out.
__global__ void quantize_kernel(const float* __restrict__ x, std::size_t blocks,
                                const std::uint8_t* __restrict__ scales, float global_scale,
                                std::uint8_t* __restrict__ codes) {
  const float4* x4 = reinterpret_cast<const float4*>(x);
  uint2* codes8 = reinterpret_cast<uint2*>(codes);
#pragma unroll kStrideUnroll
  for (std::size_t b = global_thread(); b < blocks; b += grid_threads()) {
    const float d = block_divisor(scales[b], global_scale);
    codes8[b] = quantize_block(x4 + b * (kBlockElems / 4), d);
  }
}

}  // namespace

cudaError_t launch_quantize(const float* x, std::size_t n, const std::uint8_t* scales,
                            float global_scale, std::uint8_t* codes) {
  const std::size_t blocks = n / kBlockElems;
  quantize_kernel<<<grid_for(blocks), kThreadsPerBlock>>>(x, blocks, scales, global_scale, codes);
  return cudaGetLastError();
}

}  // namespace bgraph_fp4
