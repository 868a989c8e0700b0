// A plain C++ function of the C++ library; its text comes from config/greeting.txt (file(READ)).
#include "demo.h"
#include <string>

extern "C" const char* demo_cpp_greet(void) {
  static const std::string text = DEMO_GREETING;
  return text.c_str();
}
