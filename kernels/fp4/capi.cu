// C ABI (bgraph_fp4.h): argument checks, device buffers, copies and kernel launches.
#include <cmath>
#include <string>
#include <utility>

#include "bgraph_fp4.h"
#include "fp4.cuh"

namespace {

using bgraph_fp4::kBlockElems;

thread_local std::string last_error;

int fail(int code, std::string message) {
  last_error = std::move(message);
  return code;
}

int cuda_fail(cudaError_t err, const char* call) {
  return fail(BGRAPH_FP4_ECUDA, std::string(call) + ": " + cudaGetErrorString(err));
}

// Returns from the enclosing API function with BGRAPH_FP4_ECUDA when `call` fails.
#define BGRAPH_FP4_CUDA(call)                              \
  do {                                                     \
    const cudaError_t bgraph_fp4_err_ = (call);            \
    if (bgraph_fp4_err_ != cudaSuccess) {                  \
      return cuda_fail(bgraph_fp4_err_, #call);            \
    }                                                      \
  } while (0)

// One cudaMalloc allocation, freed on every return path.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr_); }

  cudaError_t allocate(std::size_t bytes) { return cudaMalloc(&ptr_, bytes); }

  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// The recipe divides by 6 * global_scale, which must be a positive finite float.
bool valid_global_scale(float global_scale) {
  return global_scale > 0.0f && std::isfinite(bgraph_fp4::kE2M1Max * global_scale);
}

// Argument checks shared by quantize and dequantize.
int check_blocked(const void* a, const void* b, const void* c, std::size_t n, float global_scale) {
  if (a == nullptr || b == nullptr || c == nullptr) {
    return fail(BGRAPH_FP4_EINVAL, "null pointer argument");
  }
  if (n % kBlockElems != 0) {
    return fail(BGRAPH_FP4_EINVAL, "n = " + std::to_string(n) + " is not a multiple of 16");
  }
  if (!valid_global_scale(global_scale)) {
    return fail(BGRAPH_FP4_EINVAL, "global_scale must be > 0 with 6 * global_scale finite");
  }
  return BGRAPH_FP4_OK;
}

// Runs the probe kernel and copies its answer to *flag.
int probe_hw_cvt(int* flag) {
  DeviceBuffer dflag;
  BGRAPH_FP4_CUDA(dflag.allocate(sizeof(int)));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_probe_hw_cvt(dflag.get<int>()));
  BGRAPH_FP4_CUDA(cudaMemcpy(flag, dflag.get<int>(), sizeof(int), cudaMemcpyDeviceToHost));
  return BGRAPH_FP4_OK;
}

}  // namespace

extern "C" {

int bgraph_fp4_convert(const float* x, size_t n, uint8_t* codes) {
  if (n == 0) return BGRAPH_FP4_OK;
  if (x == nullptr || codes == nullptr) return fail(BGRAPH_FP4_EINVAL, "null pointer argument");
  const std::size_t bytes = (n + 1) / 2;
  DeviceBuffer dx, dcodes;
  BGRAPH_FP4_CUDA(dx.allocate(n * sizeof(float)));
  BGRAPH_FP4_CUDA(dcodes.allocate(bytes));
  BGRAPH_FP4_CUDA(cudaMemcpy(dx.get<float>(), x, n * sizeof(float), cudaMemcpyHostToDevice));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_convert(dx.get<float>(), n, dcodes.get<uint8_t>()));
  BGRAPH_FP4_CUDA(cudaMemcpy(codes, dcodes.get<uint8_t>(), bytes, cudaMemcpyDeviceToHost));
  return BGRAPH_FP4_OK;
}

int bgraph_fp4_quantize(const float* x, size_t n, float global_scale, uint8_t* codes,
                        uint8_t* scales) {
  if (n == 0) return BGRAPH_FP4_OK;
  if (const int rc = check_blocked(x, codes, scales, n, global_scale)) return rc;
  const std::size_t blocks = n / kBlockElems;
  DeviceBuffer dx, damax, dcodes, dscales;
  BGRAPH_FP4_CUDA(dx.allocate(n * sizeof(float)));
  BGRAPH_FP4_CUDA(damax.allocate(blocks * sizeof(float)));
  BGRAPH_FP4_CUDA(dcodes.allocate(n / 2));
  BGRAPH_FP4_CUDA(dscales.allocate(blocks));
  BGRAPH_FP4_CUDA(cudaMemcpy(dx.get<float>(), x, n * sizeof(float), cudaMemcpyHostToDevice));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_block_amax(dx.get<float>(), n, damax.get<float>()));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_block_scales(damax.get<float>(), blocks, global_scale,
                                                  dscales.get<uint8_t>()));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_quantize(dx.get<float>(), n, dscales.get<uint8_t>(),
                                              global_scale, dcodes.get<uint8_t>()));
  BGRAPH_FP4_CUDA(cudaMemcpy(codes, dcodes.get<uint8_t>(), n / 2, cudaMemcpyDeviceToHost));
  BGRAPH_FP4_CUDA(cudaMemcpy(scales, dscales.get<uint8_t>(), blocks, cudaMemcpyDeviceToHost));
  return BGRAPH_FP4_OK;
}

int bgraph_fp4_dequantize(const uint8_t* codes, const uint8_t* scales, size_t n,
                          float global_scale, float* out) {
  if (n == 0) return BGRAPH_FP4_OK;
  if (const int rc = check_blocked(codes, scales, out, n, global_scale)) return rc;
  const std::size_t blocks = n / kBlockElems;
  DeviceBuffer dcodes, dscales, dout;
  BGRAPH_FP4_CUDA(dcodes.allocate(n / 2));
  BGRAPH_FP4_CUDA(dscales.allocate(blocks));
  BGRAPH_FP4_CUDA(dout.allocate(n * sizeof(float)));
  BGRAPH_FP4_CUDA(cudaMemcpy(dcodes.get<uint8_t>(), codes, n / 2, cudaMemcpyHostToDevice));
  BGRAPH_FP4_CUDA(cudaMemcpy(dscales.get<uint8_t>(), scales, blocks, cudaMemcpyHostToDevice));
  BGRAPH_FP4_CUDA(bgraph_fp4::launch_dequantize(dcodes.get<uint8_t>(), dscales.get<uint8_t>(), n,
                                                global_scale, dout.get<float>()));
  BGRAPH_FP4_CUDA(cudaMemcpy(out, dout.get<float>(), n * sizeof(float), cudaMemcpyDeviceToHost));
  return BGRAPH_FP4_OK;
}

const char* bgraph_fp4_last_error(void) { return last_error.c_str(); }

int bgraph_fp4_has_hw_cvt(void) {
  int flag = -1;
  return probe_hw_cvt(&flag) == BGRAPH_FP4_OK ? flag : -1;
}

}  // extern "C"
