// Add a constant to a vector on the GPU.
#include "demo.h"
#include "demo_offset.cuh"

__global__ void offset_kernel(const float* in, float* out, int n, float by) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = demo_offset(in[i], by);
}

extern "C" int demo_cuda_offset(const float* in, float* out, int n, float by) {
  offset_kernel<<<(n + 255) / 256, 256>>>(in, out, n, by);
  return static_cast<int>(cudaGetLastError());
}
