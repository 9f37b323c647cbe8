// The CPU backend's ISA levels. Every cpu/*.cc kernel source is compiled once per level, in the
// namespace rlk::cpu::RLK_CPU_ISA (CMakeLists.txt: isa_baseline, isa_avx2, isa_avx512,
// isa_avx512bf16; or isa_native alone for a -march=native build), and cpu/dispatch.cc routes
// rlk::cpu::forward, backward, combine and saved_logits_bytes to the highest level this CPU runs, chosen
// once, at first use. RLK_CPU_ISA=<level> forces a lower one (tests; comparisons).
#pragma once

#include <string>
#include <vector>

namespace rlk::cpu {
// The level in use: the highest this CPU runs, or RLK_CPU_ISA's. Throws std::runtime_error naming
// the levels when RLK_CPU_ISA names one this build lacks or this CPU cannot run.
const char* isa();
// The levels of this build that this CPU runs, lowest first.
std::vector<std::string> isas_here();
}  // namespace rlk::cpu
