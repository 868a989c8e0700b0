// FP8 E4M3 block scales from the block maxima.
#include "fp4.cuh"

namespace bgraph_fp4 {
namespace {

// scale = e4m3(amax / (6 * global_scale)); _rn intrinsics pin IEEE rounding whatever
// the math flags, which the bit-exact reference relies on.
__global__ void block_scales_kernel(const float* __restrict__ amax, std::size_t blocks,
                                    float global_scale, std::uint8_t* __restrict__ scales) {
  const float denominator = __fmul_rn(kE2M1Max, global_scale);
#pragma unroll kStrideUnroll
  for (std::size_t b = global_thread(); b < blocks; b += grid_threads()) {
    scales[b] = e4m3_encode(__fdiv_rn(amax[b], denominator));
  }
}

}  // namespace

cudaError_t launch_block_scales(const float* amax, std::size_t blocks, float global_scale,
                                std::uint8_t* scales) {
  block_scales_kernel<<<grid_for(blocks), kThreadsPerBlock>>>(amax, blocks, global_scale, scales);
  return cudaGetLastError();
}

}  // namespace bgraph_fp4
