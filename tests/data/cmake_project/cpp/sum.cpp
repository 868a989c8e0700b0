// Sum integers on the host.
#include "demo.h"
#include <numeric>

extern "C" int demo_cpp_sum(const int* values, int n) { return std::accumulate(values, values + n, 0); }
