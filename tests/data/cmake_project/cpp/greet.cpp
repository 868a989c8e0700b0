// A plain C++ function of the C++ library.
#include "demo.h"
#include <string>

extern "C" const char* demo_cpp_greet(void) {
  static const std::string text = std::string("hello from ") + "demo_cpp";
  return text.c_str();
}
