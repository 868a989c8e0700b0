// Shared by the CUDA TUs: the per-element operations.
#pragma once

__device__ __forceinline__ float demo_scale(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 1210
  return x * DEMO_SCALE_FACTOR;  // sm_121 path
#else
  return x * DEMO_SCALE_FACTOR;
#endif
}
