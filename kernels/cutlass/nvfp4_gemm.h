/*
 * bgraph NVFP4 GEMM for consumer/edge Blackwell (SM 12.0 / 12.1), built on CUTLASS.
 *
 *   D[m, n] = alpha * sum_k (A[m, k] * SFA[m, k/16]) * (B[n, k] * SFB[n, k/16])
 *
 * Operand formats (all pointers are device pointers):
 *   a   : M x K e2m1 (NVFP4), row-major / K-major, two values per byte  -> M * K / 2 bytes
 *   b   : N x K e2m1 (NVFP4), row-major / K-major, two values per byte  -> N * K / 2 bytes
 *         (i.e. the GEMM computes A @ B^T, as torch's `a @ b.t()` with b stored [N, K])
 *   sfa : e4m3 (ue4m3) scale factor per 16 consecutive K values of A, stored in
 *         CUTLASS's interleaved Sm1xxBlockScaledConfig layout (128x4 swizzled atoms,
 *         the same "swizzled" layout used by vLLM / FlashInfer NVFP4 quantizers);
 *         bgraph_nvfp4_sfa_bytes() gives its padded size
 *   sfb : as sfa, for B;  bgraph_nvfp4_sfb_bytes()
 *   d   : M x N bfloat16, row-major
 *
 * Shape requirements (checked, error 1 otherwise): K % 32 == 0 (16-byte rows of A/B),
 * N % 8 == 0 (16-byte rows of D); pointers 16-byte aligned.
 */
#ifndef BGRAPH_KERNELS_CUTLASS_NVFP4_GEMM_H_
#define BGRAPH_KERNELS_CUTLASS_NVFP4_GEMM_H_

#include <stddef.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes of bgraph_nvfp4_gemm. */
#define BGRAPH_NVFP4_OK              0
#define BGRAPH_NVFP4_ERR_UNSUPPORTED 1 /* shape / alignment rejected by can_implement */
#define BGRAPH_NVFP4_ERR_WORKSPACE   2 /* workspace allocation failed */
#define BGRAPH_NVFP4_ERR_INIT        3 /* kernel parameter setup failed */
#define BGRAPH_NVFP4_ERR_LAUNCH      4 /* kernel launch failed */

/* Launch asynchronously on `stream`. Returns one of the codes above. */
int bgraph_nvfp4_gemm(int m, int n, int k,
                      const void* a, const void* b,
                      const void* sfa, const void* sfb,
                      void* d, float alpha, cudaStream_t stream);

/* Bytes the scale-factor buffers must hold for an (m, n, k) problem (padded layout). */
size_t bgraph_nvfp4_sfa_bytes(int m, int n, int k);
size_t bgraph_nvfp4_sfb_bytes(int m, int n, int k);

#ifdef __cplusplus
}
#endif

#endif /* BGRAPH_KERNELS_CUTLASS_NVFP4_GEMM_H_ */
