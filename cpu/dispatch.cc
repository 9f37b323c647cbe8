// Run-time choice of the CPU kernels' ISA level (cpu/dispatch.h). RLK_CPU_NATIVE (CMakeLists.txt)
// is 1 for a -march=native build, whose one level is "native".
#include "dispatch.h"

#include <cstdlib>
#include <stdexcept>

#include "rlk/linear_logp.h"

namespace rlk::cpu {
namespace {

struct Level {
  const char* name;
  bool (*runs_here)();
  size_t (*saved_logits_bytes)(const Problem&);
  Status (*forward)(const Problem&, const FwdArgs&);
  Status (*combine)(const CombineArgs&);
  Status (*backward)(const Problem&, const BwdArgs&);
};

}  // namespace

// Each level's entry points (defined by the kernel sources compiled for it) and its row of the table.
#define RLK_CPU_LEVEL(level, check)                                      \
  namespace isa_##level {                                                \
    size_t saved_logits_bytes(const Problem& p);                         \
    Status forward(const Problem& p, const FwdArgs& a);                  \
    Status combine(const CombineArgs& a);                                \
    Status backward(const Problem& p, const BwdArgs& a);                 \
  }                                                                      \
  static bool runs_##level() { return check; }                           \
  static constexpr Level kLevel_##level{#level,                          \
                                        runs_##level,                    \
                                        isa_##level::saved_logits_bytes, \
                                        isa_##level::forward,            \
                                        isa_##level::combine,            \
                                        isa_##level::backward};

// __builtin_cpu_supports checks the CPU and that the OS saves the vector registers (XCR0).
#if RLK_CPU_NATIVE
RLK_CPU_LEVEL(native, true)
static constexpr const Level* kLevels[] = {&kLevel_native};
#else
RLK_CPU_LEVEL(baseline, true)
RLK_CPU_LEVEL(avx2, __builtin_cpu_supports("x86-64-v3"))
RLK_CPU_LEVEL(avx512, __builtin_cpu_supports("x86-64-v4"))
RLK_CPU_LEVEL(avx512bf16, __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512bf16"))
static constexpr const Level* kLevels[] = {&kLevel_baseline, &kLevel_avx2, &kLevel_avx512, &kLevel_avx512bf16};
#endif
#undef RLK_CPU_LEVEL

namespace {

std::string names(bool here_only) {
  std::string s;
  for (const Level* l : kLevels)
    if (!here_only || l->runs_here()) s += std::string(s.empty() ? "" : ", ") + l->name;
  return s;
}

const Level& choose() {
  const Level* best = kLevels[0];
  for (const Level* l : kLevels)
    if (l->runs_here()) best = l;
  const char* want = std::getenv("RLK_CPU_ISA");
  if (!want || !*want) return *best;
  for (const Level* l : kLevels) {
    if (std::string(want) != l->name) continue;
    if (l->runs_here()) return *l;
    throw std::runtime_error(std::string("rlk: RLK_CPU_ISA=") + want + ": this CPU cannot run that level (it runs " +
                             names(true) + "); unset RLK_CPU_ISA or name one of those");
  }
  throw std::runtime_error(std::string("rlk: RLK_CPU_ISA=") + want + " is not a CPU level of this build (" +
                           names(false) + "); unset it or name one of those");
}

const Level& level() {
  static const Level& l = choose();  // a throw leaves it unset: the next call says the same
  return l;
}

}  // namespace

const char* isa() { return level().name; }

std::vector<std::string> isas_here() {
  std::vector<std::string> out;
  for (const Level* l : kLevels)
    if (l->runs_here()) out.emplace_back(l->name);
  return out;
}

size_t saved_logits_bytes(const Problem& p) { return level().saved_logits_bytes(p); }
Status forward(const Problem& p, const FwdArgs& a) { return level().forward(p, a); }
Status combine(const CombineArgs& a) { return level().combine(a); }
Status backward(const Problem& p, const BwdArgs& a) { return level().backward(p, a); }

}  // namespace rlk::cpu
