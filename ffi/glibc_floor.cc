// The wheel's glibc floor (scripts/build_wheel.sh). libstdc++ is linked statically
// (CMakeLists.txt), and its std::random_device, which comes along with std::runtime_error's string
// support, calls arc4random when the build machine's glibc has it (2.36 and later): that one
// symbol would raise the glibc every user needs from 2.34 to 2.36. This module never draws random
// numbers; this arc4random, hidden in the module, takes the place of glibc's, from getrandom
// (glibc 2.25).
#include <sys/random.h>

#include <cstdint>

extern "C" __attribute__((visibility("hidden"))) uint32_t arc4random(void) {
  uint32_t x = 0;
  while (getrandom(&x, sizeof x, 0) != static_cast<ssize_t>(sizeof x)) {
  }
  return x;
}
