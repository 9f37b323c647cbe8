// XLA FFI handlers for platform "cpu" over rlk::cpu.
#include "exec.h"
#include "handlers.h"

namespace rlk::ffi_handlers {
namespace {

ffi::Error ForwardCpu(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                      ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer> stats,
                      ffi::Result<ffi::AnyBuffer> target_logit, int64_t vocab_start, int64_t real_vocab,
                      int64_t chunk, int64_t ignore_index, int64_t has_bias, int64_t with_entropy) {
  CpuExec ex;
  return forward(ex, hidden, weight, bias, targets, temperature, stats, target_logit, std::nullopt,
                 {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

ffi::Error ForwardKeepCpu(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                          ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer> stats,
                          ffi::Result<ffi::AnyBuffer> target_logit, ffi::Result<ffi::AnyBuffer> kept,
                          int64_t vocab_start, int64_t real_vocab, int64_t chunk, int64_t ignore_index,
                          int64_t has_bias, int64_t with_entropy) {
  CpuExec ex;
  return forward(ex, hidden, weight, bias, targets, temperature, stats, target_logit, view(*kept, 1),
                 {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

ffi::Error CombineCpu(ffi::AnyBuffer stats, ffi::AnyBuffer target_logit, ffi::AnyBuffer targets,
                      ffi::Result<ffi::AnyBuffer> logp, ffi::Result<ffi::AnyBuffer> entropy,
                      ffi::Result<ffi::AnyBuffer> m, ffi::Result<ffi::AnyBuffer> log_s, int64_t real_vocab,
                      int64_t ignore_index) {
  CpuExec ex;
  return combine(ex, stats, target_logit, targets, logp, entropy, m, log_s, real_vocab, ignore_index);
}

ffi::Error BackwardCpu(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                       ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s, ffi::AnyBuffer entropy, ffi::AnyBuffer g,
                       ffi::AnyBuffer e, ffi::Result<ffi::AnyBuffer> dhidden, ffi::Result<ffi::AnyBuffer> dweight,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dtemp, int64_t vocab_start,
                       int64_t real_vocab, int64_t chunk, int64_t ignore_index, int64_t has_bias,
                       int64_t with_entropy) {
  CpuExec ex;
  return backward(ex, hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, std::nullopt, dhidden, dweight,
                  dbias, dtemp, {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

// kept_in and kept_out are one buffer (aliased by the caller); the CPU backend only reads it.
ffi::Error BackwardFastCpu(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                           ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s, ffi::AnyBuffer entropy, ffi::AnyBuffer g,
                           ffi::AnyBuffer e, ffi::AnyBuffer /*kept_in*/, ffi::Result<ffi::AnyBuffer> dhidden,
                           ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                           ffi::Result<ffi::AnyBuffer> dtemp, ffi::Result<ffi::AnyBuffer> kept_out, int64_t vocab_start,
                           int64_t real_vocab, int64_t chunk, int64_t ignore_index, int64_t has_bias,
                           int64_t with_entropy) {
  CpuExec ex;
  return backward(ex, hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, view(*kept_out, 1), dhidden,
                  dweight, dbias, dtemp, {vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy});
}

}  // namespace
}  // namespace rlk::ffi_handlers

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkForwardCpu, rlk::ffi_handlers::ForwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkCombineCpu, rlk::ffi_handlers::CombineCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("real_vocab").Attr<int64_t>("ignore_index"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkBackwardCpu, rlk::ffi_handlers::BackwardCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkForwardKeepCpu, rlk::ffi_handlers::ForwardKeepCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(RlkBackwardFastCpu, rlk::ffi_handlers::BackwardFastCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>() RLK_PROBLEM_ATTRS);
