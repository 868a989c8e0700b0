// bgraph: one block-scaled NVFP4 x NVFP4 -> BF16 GEMM for SM 12.0a / 12.1a (CUTLASS 3.x API).
//
// The kernel uses the SM120 block-scaled tensor-core MMA (mma.sync ... block_scale,
// e2m1 data with ue4m3 scales per 16 K values), a TMA warp-specialized mainloop and a
// 128x128x128 CTA tile on a 1x1x1 cluster (GeForce/DGX-Spark parts have no TMA multicast).
//
// Build (one arch per object; compute_120f,code=sm_120f gives one cubin for both 12.0 and 12.1):
//   nvcc -c -std=c++17 -O2 --expt-relaxed-constexpr \
//        -gencode arch=compute_120a,code=sm_120a   (or compute_121a,code=sm_121a) \
//        -I<cutlass>/include -I<cutlass>/tools/util/include nvfp4_gemm_sm120.cu

#include "nvfp4_gemm.h"

#include <cuda_runtime_api.h>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

// ---------------------------------------------------------------------------------------
// Target guard.
//
// The block-scaled MMA only exists on the arch-specific targets.  nvcc defines
// __CUDA_ARCH_FEAT_SM120_ALL for sm_120a and __CUDA_ARCH_FEAT_SM121_ALL for sm_121a
// (CUTLASS turns these into CUTLASS_ARCH_MMA_SM12{0,1}A_ENABLED and
// CUTE_ARCH_MXF4NVF4_4X_UE4M3_MMA_ENABLED).  Built for anything else (plain sm_120,
// sm_90, ...) CUTLASS would silently emit a kernel body that only printf()s an error,
// so refuse to compile instead.
// ---------------------------------------------------------------------------------------
#if defined(__CUDA_ARCH__)
#  if !(defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL) || \
        CUDA_ARCH_FAMILY(1200) || CUDA_ARCH_FAMILY(1210))
#    error "nvfp4_gemm_sm120.cu must be compiled for sm_120a or sm_121a (or the 12.x family targets)"
#  endif
#endif

#if !(defined(CUTLASS_ARCH_MMA_SM120_SUPPORTED) || defined(CUTLASS_ARCH_MMA_SM121_SUPPORTED))
#  error "this CUDA toolkit / CUTLASS has no SM120 support (needs CUDA >= 12.8, >= 12.9 for sm_121a)"
#endif

namespace {

using namespace cute;

// Operands: NVFP4 = e2m1 values + ue4m3 scale per 16 elements.
using ElementA = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using ElementB = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
using LayoutA = cutlass::layout::RowMajor;     // M x K, K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // K x N, K contiguous (== N x K row-major)
constexpr int kAlignA = 32;                    // 32 x 4 bit = 16 bytes
constexpr int kAlignB = 32;

// Output: bf16, no source tensor C (beta is always 0).
using ElementD = cutlass::bfloat16_t;
using ElementC = void;
using LayoutD = cutlass::layout::RowMajor;
using LayoutC = LayoutD;
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;  // 8
constexpr int kAlignC = kAlignD;

using ElementAcc = float;
using Arch = cutlass::arch::Sm120;
using OpClass = cutlass::arch::OpClassBlockScaledTensorOp;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    Arch, OpClass, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto,
    ElementAcc, ElementAcc,
    ElementC, LayoutC, kAlignC,
    ElementD, LayoutD, kAlignD,
    cutlass::epilogue::collective::EpilogueScheduleAuto>::CollectiveOp;

using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    Arch, OpClass,
    ElementA, LayoutA, kAlignA,
    ElementB, LayoutB, kAlignB,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<
        static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::gemm::collective::KernelScheduleAuto>::CollectiveOp;

using Kernel = cutlass::gemm::kernel::GemmUniversal<
    Shape<int, int, int, int>,  // M, N, K, L
    Mainloop, Epilogue,
    void>;                      // default (persistent) tile scheduler

using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

using StrideA = typename Kernel::StrideA;
using StrideB = typename Kernel::StrideB;
using StrideC = typename Kernel::StrideC;
using StrideD = typename Kernel::StrideD;
using SfConfig = typename Kernel::CollectiveMainloop::Sm1xxBlkScaledConfig;

using DataT = typename ElementA::DataType;         // cutlass::float_e2m1_t
using ScaleT = typename ElementA::ScaleFactorType;  // cutlass::float_ue4m3_t

typename Gemm::Arguments make_arguments(int m, int n, int k,
                                        const void* a, const void* b,
                                        const void* sfa, const void* sfb,
                                        void* d, float alpha) {
  auto problem = make_shape(m, n, k, 1);
  StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
  StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  StrideC stride_c = cutlass::make_cute_packed_stride(StrideC{}, make_shape(m, n, 1));
  StrideD stride_d = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const DataT*>(a), stride_a,
       static_cast<const DataT*>(b), stride_b,
       static_cast<const ScaleT*>(sfa), SfConfig::tile_atom_to_shape_SFA(problem),
       static_cast<const ScaleT*>(sfb), SfConfig::tile_atom_to_shape_SFB(problem)},
      {{},  // fusion (alpha/beta) arguments, set below
       nullptr, stride_c,
       static_cast<ElementD*>(d), stride_d}};
  args.epilogue.thread.alpha = alpha;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

}  // namespace

extern "C" int bgraph_nvfp4_gemm(int m, int n, int k,
                                 const void* a, const void* b,
                                 const void* sfa, const void* sfb,
                                 void* d, float alpha, cudaStream_t stream) {
  if (m <= 0 || n <= 0 || k <= 0) return BGRAPH_NVFP4_ERR_UNSUPPORTED;

  typename Gemm::Arguments args = make_arguments(m, n, k, a, b, sfa, sfb, d, alpha);
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return BGRAPH_NVFP4_ERR_UNSUPPORTED;

  // The default persistent scheduler normally needs no workspace; handle it anyway.
  size_t ws_bytes = Gemm::get_workspace_size(args);
  void* ws = nullptr;
  if (ws_bytes > 0 && cudaMallocAsync(&ws, ws_bytes, stream) != cudaSuccess) {
    return BGRAPH_NVFP4_ERR_WORKSPACE;
  }

  int rc = BGRAPH_NVFP4_OK;
  if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) {
    rc = BGRAPH_NVFP4_ERR_INIT;
  } else if (gemm.run(stream) != cutlass::Status::kSuccess) {
    rc = BGRAPH_NVFP4_ERR_LAUNCH;
  }
  if (ws != nullptr) cudaFreeAsync(ws, stream);
  return rc;
}

extern "C" size_t bgraph_nvfp4_sfa_bytes(int m, int n, int k) {
  auto layout = SfConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  return static_cast<size_t>(size(filter_zeros(layout))) * sizeof(ScaleT);
}

extern "C" size_t bgraph_nvfp4_sfb_bytes(int m, int n, int k) {
  auto layout = SfConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
  return static_cast<size_t>(size(filter_zeros(layout))) * sizeof(ScaleT);
}
