// Scale a vector on the GPU (host launcher + kernel).
#include "demo.h"
#include "demo_common.cuh"

__global__ void scale_kernel(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = demo_scale(in[i]);
}

extern "C" int demo_cuda_scale(const float* in, float* out, int n) {
  scale_kernel<<<(n + 255) / 256, 256>>>(in, out, n);
  return static_cast<int>(cudaGetLastError());
}
