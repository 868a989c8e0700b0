// Plain E2M1 conversion (no scaling) of a float array into packed codes.
#include "fp4.cuh"

namespace bgraph_fp4 {
namespace {

// One output byte per iteration; an odd n leaves the last high nibble +0.
__global__ void convert_kernel(const float* __restrict__ x, std::size_t n,
                               std::uint8_t* __restrict__ packed) {
  const std::size_t bytes = (n + 1) / 2;
#pragma unroll kStrideUnroll
  for (std::size_t i = global_thread(); i < bytes; i += grid_threads()) {
    const float lo = x[2 * i];
    const float hi = 2 * i + 1 < n ? x[2 * i + 1] : 0.0f;
    packed[i] = e2m1x2_encode(lo, hi);
  }
}

}  // namespace

cudaError_t launch_convert(const float* x, std::size_t n, std::uint8_t* packed) {
  convert_kernel<<<grid_for((n + 1) / 2), kThreadsPerBlock>>>(x, n, packed);
  return cudaGetLastError();
}

}  // namespace bgraph_fp4
