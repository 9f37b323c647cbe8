// The XLA FFI handlers as a table: one templated handler, instantiated per stage (io.h's
// ForwardIO, CombineIO, BackwardIO) and per executor (exec.h), with one binding for all of them:
// the executor from the call's context, the stage's operands and results in its table's order,
// and the attributes decoded once into io::Attrs. A platform's file (handlers_cpu.cc,
// handlers_cuda.cc) only registers: RLK_FFI_TARGETS(Platform, Exec, traits...).
//
// Every target takes its stage's kFfi fields (io.h): operands, then results, the last result the
// workspace (CUDA's scratch, sized by the frontend from the module's cuda_workspace_bytes; any
// size on the CPU, which uses none), and the six attributes of io::Attrs.
#pragma once

#include <algorithm>

#include <optional>
#include <string>

#include "exec.h"
#include "io.h"
#include "xla/ffi/api/ffi.h"

#define RLK_STRUCT_MEMBER(name) ::xla::ffi::StructMember<int64_t>(#name)
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(rlk::io::Attrs, RLK_ATTRS(RLK_STRUCT_MEMBER));

namespace rlk::ffi_handlers {

namespace ffi = xla::ffi;

// The context type that decodes into executor Exec (a CtxDecoding specialization per executor).
template <class Exec>
struct ExecOf {};

inline io::Elem elem_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return io::Elem::kF32;
    case ffi::DataType::F16: return io::Elem::kF16;
    case ffi::DataType::BF16: return io::Elem::kBF16;
    case ffi::DataType::S32: return io::Elem::kS32;
    case ffi::DataType::U8: return io::Elem::kU8;
    default: return io::Elem::kOther;
  }
}

inline io::Buf buf_of(ffi::AnyBuffer b) {
  io::Buf v;
  auto d = b.dimensions();
  v.given = true;
  v.elem = elem_of(b.element_type());
  v.dims.assign(d.begin(), d.end());
  v.data = static_cast<char*>(b.untyped_data());
  v.elem_bytes = ffi::ByteWidth(b.element_type());
  return v;
}

// The stage's buffers from the call's operands and results, by its table (io.h).
template <class IO>
io::Fail fill(IO& io, const ffi::RemainingArgs& args, const ffi::RemainingRets& rets) {
  size_t in = 0, out = 0;
  for (const auto& f : io::fields<IO>()) {
    if (!(f.flags & io::kFfi)) continue;
    const bool operand = f.flags & io::kIn;
    if ((operand ? in : out) >= (operand ? args.size() : rets.size()))
      return io::invalid(std::string("too few ") + (operand ? "operands" : "results") + ": " + f.name + " missing");
    if (operand) {
      auto b = args.get<ffi::AnyBuffer>(in++);
      if (!b.has_value()) return io::invalid(std::string(f.name) + ": " + b.error().message());
      io.*f.member = buf_of(*b);
    } else {
      auto b = rets.get<ffi::AnyBuffer>(out++);
      if (!b.has_value()) return io::invalid(std::string(f.name) + ": " + b.error().message());
      io.*f.member = buf_of(**b);
    }
    io::Buf& got = io.*f.member;  // an optional buffer with no elements is absent
    if ((f.flags & io::kOpt) && std::find(got.dims.begin(), got.dims.end(), 0) != got.dims.end()) got = io::Buf{};
  }
  if (in != args.size() || out != rets.size())
    return io::invalid("too many operands or results (" + std::to_string(args.size()) + " and " +
                       std::to_string(rets.size()) + ")");
  return io::split_all(io);
}

inline ffi::Error to_error(const io::Fail& f) {
  if (!f) return ffi::Error::Success();
  return ffi::Error(f.kind == io::Fail::kInvalid ? ffi::ErrorCode::kInvalidArgument : ffi::ErrorCode::kInternal,
                    f.what);
}

// The one handler: stage IO on executor Exec.
template <class IO, class Exec>
ffi::Error handle(Exec ex, ffi::RemainingArgs args, ffi::RemainingRets rets, io::Attrs at) {
  IO io;
  if (io::Fail f = fill(io, args, rets)) return to_error(f);
  return to_error(io::run(ex, io, at, /*batched=*/true));
}

template <class Exec>
auto binding() {
  return ffi::Ffi::Bind().Ctx<ExecOf<Exec>>().RemainingArgs().RemainingRets().template Attrs<io::Attrs>();
}

}  // namespace rlk::ffi_handlers

// The three targets of a platform: Rlk{Forward,Combine,Backward}<Platform>, over executor Exec.
#define RLK_FFI_TARGET(symbol, IO, Exec, ...)                                                                \
  extern "C" XLA_FFI_Error* symbol(XLA_FFI_CallFrame* frame) {                                               \
    static auto* handler =                                                                                   \
        rlk::ffi_handlers::binding<Exec>().To(rlk::ffi_handlers::handle<IO, Exec>, {__VA_ARGS__}).release(); \
    return handler->Call(frame);                                                                             \
  }
#define RLK_FFI_TARGETS(Platform, Exec, ...)                                  \
  RLK_FFI_TARGET(RlkForward##Platform, rlk::io::ForwardIO, Exec, __VA_ARGS__) \
  RLK_FFI_TARGET(RlkCombine##Platform, rlk::io::CombineIO, Exec, __VA_ARGS__) \
  RLK_FFI_TARGET(RlkBackward##Platform, rlk::io::BackwardIO, Exec, __VA_ARGS__)
