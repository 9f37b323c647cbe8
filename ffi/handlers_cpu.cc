// XLA FFI targets for platform "cpu": the table's handlers (handlers.h) over rlk::cpu.
#include "handlers.h"

namespace xla::ffi {
template <>
struct CtxDecoding<rlk::ffi_handlers::ExecOf<rlk::CpuExec>> {
  using Type = rlk::CpuExec;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*, DiagnosticEngine&) {
    return rlk::CpuExec{};
  }
};
}  // namespace xla::ffi

RLK_FFI_TARGETS(Cpu, rlk::CpuExec)
