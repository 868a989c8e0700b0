// The C ABI of libdemo.so.
#pragma once
#ifdef __cplusplus
extern "C" {
#endif
int demo_cuda_scale(const float* in, float* out, int n);
int demo_cuda_offset(const float* in, float* out, int n, float by);
const char* demo_cpp_greet(void);
int demo_cpp_sum(const int* values, int n);
int demo_table_value(int i);
#ifdef __cplusplus
}
#endif
