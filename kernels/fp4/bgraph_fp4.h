/* C ABI of libbgraph_fp4: NVFP4 quantization on the GPU, host pointers in and out.
 *
 * Every call allocates device memory (cudaMalloc), copies the input over, runs the
 * kernels on the current device and copies the result back before returning.
 * Return value: BGRAPH_FP4_OK, or an error code whose message
 * bgraph_fp4_last_error() gives (per thread). n == 0 is a no-op.
 * The recipe, rounding and NaN/inf policy are described in fp4.cuh and e2m1.cuh.
 */
#ifndef BGRAPH_FP4_H_
#define BGRAPH_FP4_H_

#include <stddef.h>
#include <stdint.h>

#define BGRAPH_FP4_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

enum {
  BGRAPH_FP4_OK = 0,
  BGRAPH_FP4_EINVAL = 1, /* bad argument: null pointer, n, or global_scale */
  BGRAPH_FP4_ECUDA = 2   /* a CUDA runtime call or kernel failed */
};

/* Packs x[0..n) as E2M1 codes, no scaling: codes[i] holds x[2i] in bits 0-3 and
 * x[2i+1] in bits 4-7; codes has (n + 1) / 2 bytes (an odd n pads with +0). */
BGRAPH_FP4_API int bgraph_fp4_convert(const float* x, size_t n, uint8_t* codes);

/* NVFP4-quantizes x[0..n), n a multiple of 16: codes gets n / 2 bytes packed as in
 * bgraph_fp4_convert, scales gets n / 16 FP8 E4M3 bytes. global_scale must be > 0
 * with 6 * global_scale finite in float32. */
BGRAPH_FP4_API int bgraph_fp4_quantize(const float* x, size_t n, float global_scale,
                                       uint8_t* codes, uint8_t* scales);

/* Inverse of bgraph_fp4_quantize: writes n floats (n a multiple of 16) to out. */
BGRAPH_FP4_API int bgraph_fp4_dequantize(const uint8_t* codes, const uint8_t* scales, size_t n,
                                         float global_scale, float* out);

/* Message of this thread's last failed call ("" if none failed), valid until the
 * thread's next failing call. */
BGRAPH_FP4_API const char* bgraph_fp4_last_error(void);

/* 1 if the device code picked for the current GPU converts with the hardware
 * cvt.rn.satfinite.e2m1x2 instruction, 0 if with the software path, -1 on error. */
BGRAPH_FP4_API int bgraph_fp4_has_hw_cvt(void);

#ifdef __cplusplus
}
#endif

#endif /* BGRAPH_FP4_H_ */
