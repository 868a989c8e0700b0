// Part of the shared library itself; uses the generated table.
#include "demo.h"

int demo_table_at(int i);

extern "C" int demo_table_value(int i) { return demo_table_at(i); }

// A table of their addresses keeps the CUDA and C++ parts' entry points in libdemo.so.
extern "C" void* const demo_entry_points[] = {
    reinterpret_cast<void*>(&demo_cuda_scale), reinterpret_cast<void*>(&demo_cuda_offset),
    reinterpret_cast<void*>(&demo_cpp_greet), reinterpret_cast<void*>(&demo_cpp_sum)};
