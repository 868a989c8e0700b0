// Per-block absolute maximum, the input of the block scales.
#include "fp4.cuh"

namespace bgraph_fp4 {
namespace {

// One 16-element block per iteration, read as four float4.
__global__ void block_amax_kernel(const float* __restrict__ x, std::size_t blocks,
                                  float* __restrict__ amax) {
  const float4* blocks4 = reinterpret_cast<const float4*>(x);
#pragma unroll kStrideUnroll
  for (std::size_t b = global_thread(); b < blocks; b += grid_threads()) {
    float m = 0.0f;
#pragma unroll
    for (std::size_t q = 0; q < kBlockElems / 4; ++q) {
      const float4 v = blocks4[b * (kBlockElems / 4) + q];
      // fmaxf returns the non-NaN operand, so NaNs drop out of the maximum.
      m = fmaxf(fmaxf(m, fabsf(v.x)), fmaxf(fabsf(v.y), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    amax[b] = m;
  }
}

}  // namespace

cudaError_t launch_block_amax(const float* x, std::size_t n, float* amax) {
  const std::size_t blocks = n / kBlockElems;
  block_amax_kernel<<<grid_for(blocks), kThreadsPerBlock>>>(x, blocks, amax);
  return cudaGetLastError();
}

}  // namespace bgraph_fp4
