// Sum integers on the host, from a start value in a header found through -isystem.
#include "demo.h"
#include <demo_sum_start.h>
#include <numeric>

extern "C" int demo_cpp_sum(const int* values, int n) { return std::accumulate(values, values + n, DEMO_SUM_START); }
