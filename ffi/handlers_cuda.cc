// XLA FFI targets for platform "CUDA": the table's handlers (handlers.h) over rlk::cuda, on the
// call's stream. Command-buffer compatible: the kernels allocate nothing (scratch is the trailing
// `workspace` result, sized by the frontend from the module's cuda_workspace_bytes), never
// synchronise the host and choose launches from shapes.
#include "handlers.h"

namespace xla::ffi {
template <>
struct CtxDecoding<rlk::ffi_handlers::ExecOf<rlk::CudaExec>> {
  using Type = rlk::CudaExec;
  static std::optional<Type> Decode(const XLA_FFI_Api* api, XLA_FFI_ExecutionContext* ctx, DiagnosticEngine& diag) {
    const auto stream = CtxDecoding<PlatformStream<cudaStream_t>>::Decode(api, ctx, diag);
    if (!stream) return std::nullopt;
    return rlk::CudaExec{*stream};
  }
};
}  // namespace xla::ffi

RLK_FFI_TARGETS(Cuda, rlk::CudaExec, xla::ffi::Traits::kCmdBufferCompatible)
