// nv_fp4_dummy.h: FP4 (E2M1) types and conversions for CUDA toolkits without cuda_fp4.h (CUDA
// 12.8), in the role of the legacy DGX Spark image's shim of that name. //toolchains:fp4-shim
// makes it a target; //toolchains:cccl-patched puts it at include/nv_fp4_dummy.h, where the
// patched CCCL includes it instead of cuda_fp4.h when the toolkit has none.
//
// CUDA 13.0 ships cuda_fp4.h (__nv_fp4_e2m1 and friends): where it exists this header is that
// one and defines nothing of its own (and the patched CCCL does not include it: `bgraph audit`).
#pragma once

#if defined(__has_include)
#  if __has_include(<cuda_fp4.h>)
#    include <cuda_fp4.h>
#  endif
#endif

#if !defined(__CUDA_FP4_TYPES_EXIST__) && !defined(__CUDA_FP4_H__)
#define __CUDA_FP4_TYPES_EXIST__
#define NV_FP4_DUMMY 1

#if defined(__CUDACC__)
#  include <vector_types.h>
#  define NV_FP4_DUMMY_FN __host__ __device__ __forceinline__
#else
#  define NV_FP4_DUMMY_FN inline
#endif

typedef unsigned char __nv_fp4_storage_t;
typedef unsigned char __nv_fp4x2_storage_t;
typedef unsigned short __nv_fp4x4_storage_t;

typedef enum __nv_fp4_interpretation_t { __NV_E2M1 } __nv_fp4_interpretation_t;

// float -> E2M1 code (sign in bit 3, magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6): round to nearest
// even, saturating at 6; NaN saturates too (E2M1 has no NaN).
NV_FP4_DUMMY_FN __nv_fp4_storage_t nv_fp4_dummy_encode(float x) {
  const float a = x < 0.0f ? -x : x;
  unsigned code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                  (a > 5.0f);
  if (a != a) {
    code = 7;
  }
  return (__nv_fp4_storage_t)((x < 0.0f ? 8u : 0u) | code);
}

NV_FP4_DUMMY_FN float nv_fp4_dummy_decode(__nv_fp4_storage_t code) {
  const unsigned m = code & 7u;
  const float mag = m < 4u ? 0.5f * (float)m : (m == 4u ? 2.0f : (m == 5u ? 3.0f : (m == 6u ? 4.0f : 6.0f)));
  return (code & 8u) ? -mag : mag;
}

// The conversion intrinsics' shape (the rounding mode is always to nearest even here).
NV_FP4_DUMMY_FN __nv_fp4_storage_t __nv_cvt_float_to_fp4(float x, __nv_fp4_interpretation_t, int = 0) {
  return nv_fp4_dummy_encode(x);
}

NV_FP4_DUMMY_FN __nv_fp4x2_storage_t __nv_cvt_float2_to_fp4x2(float lo, float hi, __nv_fp4_interpretation_t,
                                                              int = 0) {
  return (__nv_fp4x2_storage_t)(nv_fp4_dummy_encode(lo) | (nv_fp4_dummy_encode(hi) << 4));
}

struct __nv_fp4_e2m1 {
  __nv_fp4_storage_t __x;

  NV_FP4_DUMMY_FN __nv_fp4_e2m1() : __x(0) {}
  explicit NV_FP4_DUMMY_FN __nv_fp4_e2m1(float f) : __x(nv_fp4_dummy_encode(f)) {}
  explicit NV_FP4_DUMMY_FN __nv_fp4_e2m1(double f) : __x(nv_fp4_dummy_encode((float)f)) {}
  explicit NV_FP4_DUMMY_FN operator float() const { return nv_fp4_dummy_decode(__x); }
  explicit NV_FP4_DUMMY_FN operator double() const { return (double)nv_fp4_dummy_decode(__x); }
};

// Two values in one byte, the first in the low nibble.
struct __nv_fp4x2_e2m1 {
  __nv_fp4x2_storage_t __x;

  NV_FP4_DUMMY_FN __nv_fp4x2_e2m1() : __x(0) {}
#if defined(__CUDACC__)
  explicit NV_FP4_DUMMY_FN __nv_fp4x2_e2m1(float2 f) : __x(__nv_cvt_float2_to_fp4x2(f.x, f.y, __NV_E2M1)) {}
  explicit NV_FP4_DUMMY_FN operator float2() const {
    return make_float2(nv_fp4_dummy_decode(__x & 0xf), nv_fp4_dummy_decode(__x >> 4));
  }
#endif
};

// Four values in two bytes.
struct __nv_fp4x4_e2m1 {
  __nv_fp4x4_storage_t __x;

  NV_FP4_DUMMY_FN __nv_fp4x4_e2m1() : __x(0) {}
};

#undef NV_FP4_DUMMY_FN
#endif  // !__CUDA_FP4_TYPES_EXIST__
