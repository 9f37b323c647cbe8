// _rlk_core: the one compiled module both frontends import. It exports the XLA FFI handler
// capsules (for rlk_xla), the DLPack entry points (for torch_bridge), the canonical chunk rule,
// workspace sizes and the route counters.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "rlk/linear_logp.h"

#if RLK_HAVE_XLA_FFI
#include "xla/ffi/api/c_api.h"
extern "C" {
XLA_FFI_Error* RlkForwardCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkCombineCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardCpu(XLA_FFI_CallFrame*);
#if RLK_HAVE_CUDA
XLA_FFI_Error* RlkForwardCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkCombineCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardCuda(XLA_FFI_CallFrame*);
#endif
}
#endif

#if RLK_HAVE_CUDA
#include "linear_logp_cuda.h"
#endif

namespace nb = nanobind;

namespace {

template <class Fn>
nb::capsule capsule_of(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

rlk::Problem shape_problem(int64_t n, int64_t h, int64_t v, int64_t chunk, int dtype, bool has_bias,
                           bool with_entropy) {
  rlk::Problem p;
  p.n = n;
  p.h = h;
  p.v = v;
  p.chunk = chunk;
  p.real_vocab = v;
  p.dtype = rlk::DType(dtype);
  p.has_bias = has_bias;
  p.with_entropy = with_entropy;
  return p;
}

}  // namespace

NB_MODULE(_rlk_core, m) {
  m.attr("STAT_WIDTH") = rlk::kStatWidth;
  m.attr("MAX_INVARIANT_TP") = rlk::kMaxInvariantTp;
  m.attr("has_xla_ffi") = bool(RLK_HAVE_XLA_FFI);
  m.attr("has_cuda") = bool(RLK_HAVE_CUDA);

  m.def("canonical_chunk", &rlk::canonical_chunk, nb::arg("vocab_global"),
        "Canonical chunk width of a global (padded) vocab: depends on the vocab size only.");

  m.def("ffi_targets", [] {
    nb::dict out;
#if RLK_HAVE_XLA_FFI
    nb::dict cpu;
    cpu["rlk_forward"] = capsule_of(RlkForwardCpu);
    cpu["rlk_combine"] = capsule_of(RlkCombineCpu);
    cpu["rlk_backward"] = capsule_of(RlkBackwardCpu);
    out["cpu"] = cpu;
#if RLK_HAVE_CUDA
    nb::dict gpu;
    gpu["rlk_forward"] = capsule_of(RlkForwardCuda);
    gpu["rlk_combine"] = capsule_of(RlkCombineCuda);
    gpu["rlk_backward"] = capsule_of(RlkBackwardCuda);
    out["CUDA"] = gpu;
#endif
#endif
    return out;
  });

  m.def("cuda_workspace_bytes",
        [](int64_t n, int64_t h, int64_t v, int64_t chunk, int dtype, bool has_bias, bool with_entropy) {
#if RLK_HAVE_CUDA
          const rlk::Problem p = shape_problem(n, h, v, chunk, dtype, has_bias, with_entropy);
          return std::make_tuple(int64_t(rlk::cuda::forward_workspace_bytes(p)),
                                 int64_t(rlk::cuda::backward_workspace_bytes(p)));
#else
          (void)shape_problem(n, h, v, chunk, dtype, has_bias, with_entropy);
          return std::make_tuple(int64_t(0), int64_t(0));
#endif
        },
        nb::arg("n"), nb::arg("h"), nb::arg("v"), nb::arg("chunk"), nb::arg("dtype"), nb::arg("has_bias"),
        nb::arg("with_entropy"), "(forward, backward) CUDA workspace bytes for this problem shape.");

  m.def("route_counts", [] {
    nb::dict out;
    for (int b = 0; b < int(rlk::Backend::kCount); ++b) {
      const rlk::RouteCounts c = rlk::read_counts(rlk::Backend(b));
      out[rlk::backend_name(rlk::Backend(b))] =
          nb::make_tuple(c.fwd_calls, c.fwd_tokens, c.bwd_calls, c.bwd_tokens);
    }
    return out;
  });
  m.def("reset_route_counts", &rlk::reset_counts);
}
