// XLA FFI handlers for platform "CUDA" over rlk::cuda. Command-buffer compatible: the kernels
// allocate nothing (scratch is the trailing `workspace` result, sized by the frontend from
// rlk::cuda::*_workspace_bytes), never synchronise the host and choose launches from shapes.
#include "exec.h"
#include "handlers.h"

namespace rlk::ffi_handlers {
namespace {

cuda::Workspace workspace_of(ffi::Result<ffi::AnyBuffer>& w) { return {w->untyped_data(), w->size_bytes()}; }

ffi::Error ForwardCuda(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                       ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer> stats,
                       ffi::Result<ffi::AnyBuffer> target_logit, ffi::Result<ffi::AnyBuffer> workspace,
                       int64_t vocab_start, int64_t real_vocab, int64_t chunk, int64_t ignore_index,
                       int64_t has_bias, int64_t with_entropy) {
  CudaExec ex{stream, workspace_of(workspace)};
  return forward(ex, hidden, weight, bias, targets, temperature, stats, target_logit, std::nullopt,
                 {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

ffi::Error ForwardKeepCuda(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer> stats,
                           ffi::Result<ffi::AnyBuffer> target_logit, ffi::Result<ffi::AnyBuffer> kept,
                           ffi::Result<ffi::AnyBuffer> workspace, int64_t vocab_start, int64_t real_vocab,
                           int64_t chunk, int64_t ignore_index, int64_t has_bias, int64_t with_entropy) {
  CudaExec ex{stream, workspace_of(workspace)};
  return forward(ex, hidden, weight, bias, targets, temperature, stats, target_logit, view(*kept, 1),
                 {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

ffi::Error CombineCuda(cudaStream_t stream, ffi::AnyBuffer stats, ffi::AnyBuffer target_logit,
                       ffi::AnyBuffer targets, ffi::Result<ffi::AnyBuffer> logp, ffi::Result<ffi::AnyBuffer> entropy,
                       ffi::Result<ffi::AnyBuffer> m, ffi::Result<ffi::AnyBuffer> log_s, int64_t real_vocab,
                       int64_t ignore_index) {
  CudaExec ex{stream, {}};
  return combine(ex, stats, target_logit, targets, logp, entropy, m, log_s, real_vocab, ignore_index);
}

ffi::Error BackwardCuda(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                        ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s, ffi::AnyBuffer entropy,
                        ffi::AnyBuffer g, ffi::AnyBuffer e, ffi::Result<ffi::AnyBuffer> dhidden,
                        ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                        ffi::Result<ffi::AnyBuffer> dtemp, ffi::Result<ffi::AnyBuffer> workspace, int64_t vocab_start,
                        int64_t real_vocab, int64_t chunk, int64_t ignore_index, int64_t has_bias,
                        int64_t with_entropy) {
  CudaExec ex{stream, workspace_of(workspace)};
  return backward(ex, hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, std::nullopt, dhidden, dweight,
                  dbias, dtemp, {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

// kept_in and kept_out are one buffer (aliased by the caller): dlogit overwrites it.
ffi::Error BackwardFastCuda(cudaStream_t stream, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                            ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s, ffi::AnyBuffer entropy,
                            ffi::AnyBuffer g, ffi::AnyBuffer e, ffi::AnyBuffer /*kept_in*/,
                            ffi::Result<ffi::AnyBuffer> dhidden, ffi::Result<ffi::AnyBuffer> dweight,
                            ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dtemp,
                            ffi::Result<ffi::AnyBuffer> kept_out, ffi::Result<ffi::AnyBuffer> workspace,
                            int64_t vocab_start, int64_t real_vocab, int64_t chunk, int64_t ignore_index,
                            int64_t has_bias, int64_t with_entropy) {
  CudaExec ex{stream, workspace_of(workspace)};
  return backward(ex, hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, view(*kept_out, 1), dhidden,
                  dweight, dbias, dtemp, {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

}  // namespace
}  // namespace rlk::ffi_handlers

namespace ffi = xla::ffi;
using Stream = ffi::PlatformStream<cudaStream_t>;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkForwardCuda, rlk::ffi_handlers::ForwardCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  RLK_PROBLEM_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkCombineCuda, rlk::ffi_handlers::CombineCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("real_vocab").Attr<int64_t>("ignore_index"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkBackwardCuda, rlk::ffi_handlers::BackwardCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkForwardKeepCuda, rlk::ffi_handlers::ForwardKeepCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkBackwardFastCuda, rlk::ffi_handlers::BackwardFastCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<Stream>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
