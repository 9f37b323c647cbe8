// _rlk_core: the one compiled module both frontends import. It exports the XLA FFI handler
// capsules (for rlk_xla), the DLPack entry points (for torch_bridge), the canonical chunk rule,
// workspace sizes and the route counters.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <stdexcept>

#include "dispatch.h"
#include "lean_plan.h"
#include "rlk/linear_logp.h"

#if RLK_HAVE_XLA_FFI
#include "xla/ffi/api/c_api.h"
extern "C" {
XLA_FFI_Error* RlkForwardCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkForwardKeepCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkCombineCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardCpu(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardFastCpu(XLA_FFI_CallFrame*);
#if RLK_HAVE_CUDA
XLA_FFI_Error* RlkForwardCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkForwardKeepCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkCombineCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardCuda(XLA_FFI_CallFrame*);
XLA_FFI_Error* RlkBackwardFastCuda(XLA_FFI_CallFrame*);
#endif
}
#endif

#include "exec.h"

namespace nb = nanobind;

namespace {

#if RLK_HAVE_XLA_FFI
using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// One platform's FFI targets, by the names the frontend calls them.
nb::dict targets(Handler* forward, Handler* forward_keep, Handler* combine, Handler* backward,
                 Handler* backward_fast) {
  nb::dict d;
  const std::pair<const char*, Handler*> named[] = {{"rlk_forward", forward}, {"rlk_forward_keep", forward_keep},
                                                    {"rlk_combine", combine}, {"rlk_backward", backward},
                                                    {"rlk_backward_fast", backward_fast}};
  for (const auto& [name, fn] : named) d[name] = nb::capsule(reinterpret_cast<void*>(fn));
  return d;
}
#endif

rlk::Problem shape_problem(int64_t n, int64_t h, int64_t v, int64_t chunk, rlk::DType dtype, bool has_bias,
                           bool with_entropy) {
  rlk::Problem p;
  p.n = n;
  p.h = h;
  p.v = v;
  p.chunk = chunk;
  p.real_vocab = v;
  p.dtype = dtype;
  p.has_bias = has_bias;
  p.with_entropy = with_entropy;
  return p;
}

// ---- DLPack entry points (torch_bridge) ---------------------------------------------------------
// Arrays arrive through DLPack (nb::ndarray, no conversion: a wrong dtype or layout is an error,
// never a silent copy). Outputs and scratch are allocated by the caller (torch's allocator); the
// CUDA calls run on the caller's stream.
using Array = nb::ndarray<nb::c_contig>;

rlk::DType dtype_of(const Array& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return rlk::DType::kF32;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return rlk::DType::kBF16;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return rlk::DType::kF16;
  throw std::invalid_argument(std::string("rlk: ") + name + " must be float32, float16 or bfloat16");
}

void expect(const Array& a, nb::dlpack::dtype t, std::initializer_list<int64_t> shape, int device, const char* name) {
  bool ok = a.dtype() == t && a.ndim() == shape.size() && a.device_type() == device;
  size_t i = 0;
  for (int64_t d : shape) ok = ok && int64_t(a.shape(i++)) == d;
  if (!ok) throw std::invalid_argument(std::string("rlk: ") + name + " has the wrong dtype, shape or device");
}

struct Call {
  rlk::Problem p;
  int device;
};

Call make_call(const Array& hidden, const Array& weight, const std::optional<Array>& bias, const Array& targets,
               const Array& temperature, int64_t vocab_start, int64_t real_vocab, int64_t chunk, int64_t ignore_index,
               bool with_entropy) {
  Call c;
  c.device = hidden.device_type();
  if (c.device != nb::device::cpu::value && c.device != nb::device::cuda::value)
    throw std::invalid_argument("rlk: tensors must be on the CPU or a CUDA device");
  if (hidden.ndim() != 2 || weight.ndim() != 2) throw std::invalid_argument("rlk: hidden and weight must be 2-D");
  rlk::Problem& p = c.p;
  p.dtype = dtype_of(hidden, "hidden");
  p.n = int64_t(hidden.shape(0));
  p.h = int64_t(hidden.shape(1));
  p.v = int64_t(weight.shape(0));
  expect(weight, hidden.dtype(), {p.v, p.h}, c.device, "weight");
  if (bias) expect(*bias, nb::dtype<float>(), {p.v}, c.device, "bias");
  expect(targets, nb::dtype<int32_t>(), {p.n}, c.device, "targets");
  expect(temperature, nb::dtype<float>(), {p.n}, c.device, "temperature");
  p.vocab_start = vocab_start;
  p.real_vocab = real_vocab;
  p.chunk = chunk;
  p.ignore_index = ignore_index;
  p.has_bias = bias.has_value();
  p.with_entropy = with_entropy;
  if (chunk <= 0 || p.v % chunk != 0) throw std::invalid_argument("rlk: chunk must divide the local vocab");
  return c;
}

void check(rlk::Status s) {
  if (s) throw std::runtime_error(s);
}

// Run `call(executor)` on the arrays' device: the same executors as the XLA FFI handlers.
template <class Call>
void run_on(int device, const std::optional<Array>& workspace, uintptr_t stream, Call&& call) {
  if (device == nb::device::cpu::value) {
    nb::gil_scoped_release nogil;
    rlk::CpuExec ex;
    check(call(ex));
    return;
  }
#if RLK_HAVE_CUDA
  rlk::CudaExec ex{reinterpret_cast<cudaStream_t>(stream),
                   workspace ? rlk::cuda::Workspace{workspace->data(), workspace->nbytes()} : rlk::cuda::Workspace{}};
  check(call(ex));
#else
  (void)workspace, (void)stream;
  throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
}

// The kept buffer's bytes on a device (nb::device::cpu or cuda) for this problem.
size_t kept_bytes_on(int device, const rlk::Problem& p) {
  if (device == nb::device::cpu::value) return rlk::cpu::kept_bytes(p);
#if RLK_HAVE_CUDA
  return rlk::cuda::kept_bytes(p);
#else
  throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
}

// The kept buffer: uint8 [kept_bytes] on the call's device.
void* kept_of(const std::optional<Array>& logits, const Call& c) {
  if (!logits) return nullptr;
  expect(*logits, nb::dtype<uint8_t>(), {int64_t(kept_bytes_on(c.device, c.p))}, c.device,
         "logits (the kept buffer: uint8 [kept_bytes])");
  return logits->data();
}

// A top-p nucleus: uint8 [n, v] (torch passes its bool mask viewed as uint8) on `device`, or null.
const uint8_t* keep_of(const std::optional<Array>& keep, int64_t n, int64_t v, int device) {
  if (!keep) return nullptr;
  expect(*keep, nb::dtype<uint8_t>(), {n, v}, device, "keep (the nucleus: uint8 [n, v_local])");
  return static_cast<const uint8_t*>(keep->data());
}

// The combine of `stats` [n, k, kStatWidth] into logp, entropy, m and log_s [n] (all f32 on `device`);
// with keep_sum [n, k] the nucleus's logp, and its log_s_keep [n] into `log_s_keep`.
rlk::CombineArgs combine_args(const Array& stats, const Array& target_logit, const Array& targets, const Array& logp,
                              const Array& entropy, const Array& m, const Array& log_s,
                              const std::optional<Array>& keep_sum, const std::optional<Array>& log_s_keep,
                              int64_t real_vocab, int64_t ignore_index, int device) {
  if (stats.ndim() != 3 || stats.shape(2) != size_t(rlk::kStatWidth))
    throw std::invalid_argument("rlk: stats must be [n, chunks, 3]");
  rlk::CombineArgs a;
  a.n = int64_t(stats.shape(0));
  a.k = int64_t(stats.shape(1));
  expect(stats, nb::dtype<float>(), {a.n, a.k, rlk::kStatWidth}, device, "stats");
  expect(target_logit, nb::dtype<float>(), {a.n}, device, "target_logit");
  expect(targets, nb::dtype<int32_t>(), {a.n}, device, "targets");
  for (const Array* o : {&logp, &entropy, &m, &log_s}) expect(*o, nb::dtype<float>(), {a.n}, device, "combine output");
  if (keep_sum.has_value() != log_s_keep.has_value())
    throw std::invalid_argument("rlk: keep_sum and log_s_keep come together");
  if (keep_sum) {
    expect(*keep_sum, nb::dtype<float>(), {a.n, a.k}, device, "keep_sum");
    expect(*log_s_keep, nb::dtype<float>(), {a.n}, device, "log_s_keep");
    a.keep_sum = static_cast<const float*>(keep_sum->data());
    a.log_s_keep = static_cast<float*>(log_s_keep->data());
  }
  a.real_vocab = real_vocab;
  a.ignore_index = ignore_index;
  a.stats = static_cast<const float*>(stats.data());
  a.target_logit = static_cast<const float*>(target_logit.data());
  a.targets = static_cast<const int32_t*>(targets.data());
  a.logp = static_cast<float*>(logp.data());
  a.entropy = static_cast<float*>(entropy.data());
  a.m = static_cast<float*>(m.data());
  a.log_s = static_cast<float*>(log_s.data());
  return a;
}

// The forward statistics and, when logp, entropy, m and log_s are given (a call over the whole vocab),
// their combine in the same call: one entry point per single-shard forward keeps the host's share
// of a small call low. With keep (a nucleus) also keep_sum, and log_s_keep when combining.
void dl_forward(Array hidden, Array weight, std::optional<Array> bias, Array targets, Array temperature, Array stats,
                Array target_logit, std::optional<Array> logits, std::optional<Array> workspace, int64_t vocab_start,
                int64_t real_vocab, int64_t chunk, int64_t ignore_index, bool with_entropy, uintptr_t stream,
                std::optional<Array> logp, std::optional<Array> entropy, std::optional<Array> m,
                std::optional<Array> log_s, std::optional<Array> keep, std::optional<Array> keep_sum,
                std::optional<Array> log_s_keep) {
  const Call c = make_call(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                           with_entropy);
  expect(stats, nb::dtype<float>(), {c.p.n, rlk::num_chunks(c.p), rlk::kStatWidth}, c.device, "stats");
  expect(target_logit, nb::dtype<float>(), {c.p.n}, c.device, "target_logit");
  const bool combine = logp.has_value();
  if (combine != entropy.has_value() || combine != m.has_value() || combine != log_s.has_value())
    throw std::invalid_argument("rlk: logp, entropy, m and log_s come together");
  if (combine && (vocab_start != 0 || c.p.v < real_vocab))
    throw std::invalid_argument("rlk: the forward combines only a call over the whole vocab");
  if (keep.has_value() != keep_sum.has_value()) throw std::invalid_argument("rlk: keep and keep_sum come together");
  if (keep_sum) expect(*keep_sum, nb::dtype<float>(), {c.p.n, rlk::num_chunks(c.p)}, c.device, "keep_sum");
  rlk::FwdArgs a;
  a.hidden = hidden.data();
  a.weight = weight.data();
  a.bias = bias ? static_cast<const float*>(bias->data()) : nullptr;
  a.targets = static_cast<const int32_t*>(targets.data());
  a.temperature = static_cast<const float*>(temperature.data());
  a.stats = static_cast<float*>(stats.data());
  a.target_logit = static_cast<float*>(target_logit.data());
  a.keep = keep_of(keep, c.p.n, c.p.v, c.device);
  a.keep_sum = keep_sum ? static_cast<float*>(keep_sum->data()) : nullptr;
  a.logits = kept_of(logits, c);
  if (log_s_keep.has_value() != (combine && keep.has_value()))
    throw std::invalid_argument("rlk: log_s_keep comes with keep in a combining forward");
  const rlk::CombineArgs ca =
      combine ? combine_args(stats, target_logit, targets, *logp, *entropy, *m, *log_s, keep_sum, log_s_keep,
                             real_vocab, ignore_index, c.device)
              : rlk::CombineArgs{};
  run_on(c.device, workspace, stream, [&](auto& ex) {
    if (rlk::Status s = ex.forward(c.p, a)) return s;
    return combine ? ex.combine(ca) : rlk::Status{};
  });
}

void dl_combine(Array stats, Array target_logit, Array targets, Array logp, Array entropy, Array m, Array log_s,
                int64_t real_vocab, int64_t ignore_index, uintptr_t stream, std::optional<Array> keep_sum,
                std::optional<Array> log_s_keep) {
  const rlk::CombineArgs a = combine_args(stats, target_logit, targets, logp, entropy, m, log_s, keep_sum, log_s_keep,
                                          real_vocab, ignore_index, stats.device_type());
  run_on(stats.device_type(), std::nullopt, stream, [&](auto& ex) { return ex.combine(a); });
}

void dl_backward(Array hidden, Array weight, std::optional<Array> bias, Array targets, Array temperature, Array m,
                 Array log_s,
                 std::optional<Array> entropy, Array g, std::optional<Array> e, std::optional<Array> logits,
                 Array dhidden, Array dweight,
                 std::optional<Array> dbias, Array dtemp, std::optional<Array> workspace, int64_t vocab_start,
                 int64_t real_vocab, int64_t chunk, int64_t ignore_index, uintptr_t stream, std::optional<Array> keep,
                 std::optional<Array> log_s_keep) {
  const bool with_entropy = entropy.has_value() && e.has_value();
  const Call c = make_call(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                           with_entropy);
  const rlk::Problem& p = c.p;
  expect(m, nb::dtype<float>(), {p.n}, c.device, "m");
  expect(log_s, nb::dtype<float>(), {p.n}, c.device, "log_s");
  expect(g, nb::dtype<float>(), {p.n}, c.device, "g");
  if (with_entropy) {
    expect(*entropy, nb::dtype<float>(), {p.n}, c.device, "entropy");
    expect(*e, nb::dtype<float>(), {p.n}, c.device, "e");
  }
  const rlk::DType dh_dtype = dtype_of(dhidden, "dhidden");  // f32 or hidden's: the backend checks
  expect(dhidden, dhidden.dtype(), {p.n, p.h}, c.device, "dhidden");
  expect(dweight, hidden.dtype(), {p.v, p.h}, c.device, "dweight");
  if (bias && !dbias) throw std::invalid_argument("rlk: dbias is required with bias");
  if (dbias) expect(*dbias, nb::dtype<float>(), {p.v}, c.device, "dbias");
  expect(dtemp, nb::dtype<float>(), {p.n}, c.device, "dtemp");
  if (keep.has_value() != log_s_keep.has_value()) throw std::invalid_argument("rlk: keep and log_s_keep come together");
  if (log_s_keep) expect(*log_s_keep, nb::dtype<float>(), {p.n}, c.device, "log_s_keep");
  rlk::BwdArgs a;
  a.hidden = hidden.data();
  a.weight = weight.data();
  a.bias = bias ? static_cast<const float*>(bias->data()) : nullptr;
  a.targets = static_cast<const int32_t*>(targets.data());
  a.temperature = static_cast<const float*>(temperature.data());
  a.m = static_cast<const float*>(m.data());
  a.log_s = static_cast<const float*>(log_s.data());
  a.entropy = with_entropy ? static_cast<const float*>(entropy->data()) : nullptr;
  a.g = static_cast<const float*>(g.data());
  a.e = with_entropy ? static_cast<const float*>(e->data()) : nullptr;
  a.keep = keep_of(keep, p.n, p.v, c.device);
  a.log_s_keep = log_s_keep ? static_cast<const float*>(log_s_keep->data()) : nullptr;
  a.logits = kept_of(logits, c);
  a.dhidden = dhidden.data();
  a.dhidden_dtype = dh_dtype;
  a.dweight = dweight.data();
  a.dbias = (bias && dbias) ? static_cast<float*>(dbias->data()) : nullptr;
  a.dtemp = static_cast<float*>(dtemp.data());
  run_on(c.device, workspace, stream, [&](auto& ex) { return ex.backward(p, a); });
}

}  // namespace

NB_MODULE(_rlk_core, m) {
  m.attr("STAT_WIDTH") = rlk::kStatWidth;
  m.attr("MAX_INVARIANT_TP") = rlk::kMaxInvariantTp;
  m.attr("has_xla_ffi") = bool(RLK_HAVE_XLA_FFI);
  m.attr("has_cuda") = bool(RLK_HAVE_CUDA);
  // The CPU kernels' ISA level in use and the levels this CPU runs (cpu/dispatch.h). Read here, so
  // that a bad RLK_CPU_ISA fails the import with its message.
  m.attr("cpu_isa") = rlk::cpu::isa();
  m.attr("cpu_isas") = rlk::cpu::isas_here();

  // The operand dtypes, named as jax and torch name them; the codes are rlk::DType's.
  nb::enum_<rlk::DType>(m, "DType", "Operand dtype of a problem shape (rlk::DType).")
      .value("float32", rlk::DType::kF32)
      .value("float16", rlk::DType::kF16)
      .value("bfloat16", rlk::DType::kBF16);

  m.def("canonical_chunk", &rlk::canonical_chunk, nb::arg("vocab_global"),
        "Canonical chunk width of a global (padded) vocab: depends on the vocab size only.");

  m.def("ffi_targets", [] {
    nb::dict out;
#if RLK_HAVE_XLA_FFI
    out["cpu"] = targets(RlkForwardCpu, RlkForwardKeepCpu, RlkCombineCpu, RlkBackwardCpu, RlkBackwardFastCpu);
#if RLK_HAVE_CUDA
    out["CUDA"] = targets(RlkForwardCuda, RlkForwardKeepCuda, RlkCombineCuda, RlkBackwardCuda, RlkBackwardFastCuda);
#endif
#endif
    return out;
  });

  m.def("kept_bytes",
        [](int64_t n, int64_t v, int64_t chunk, rlk::DType dtype, const std::string& device) {
          if (device != "cpu" && device != "cuda")
            throw std::invalid_argument("rlk: kept_bytes device must be 'cpu' or 'cuda', got '" + device + "'");
          if (chunk <= 0 || v % chunk != 0) throw std::invalid_argument("rlk: chunk must divide the local vocab");
          const rlk::Problem p = shape_problem(n, 0, v, chunk, dtype, false, false);
          return int64_t(kept_bytes_on(device == "cpu" ? nb::device::cpu::value : nb::device::cuda::value, p));
        },
        nb::arg("n"), nb::arg("v"), nb::arg("chunk"), nb::arg("dtype").noconvert(), nb::arg("device"),
        "Bytes of the fast backward's kept buffer (uint8) on device 'cpu' or 'cuda' for this problem shape:\n"
        "each backend keeps what its backward reads, in its own layout.");

  m.def("cuda_workspace_bytes",
        [](int64_t n, int64_t h, int64_t v, int64_t chunk, rlk::DType dtype, bool has_bias, bool with_entropy,
           bool dhidden_f32) {
          nb::dict out;
#if RLK_HAVE_CUDA
          const rlk::Problem p = shape_problem(n, h, v, chunk, dtype, has_bias, with_entropy);
          const rlk::DType dh = dhidden_f32 ? rlk::DType::kF32 : p.dtype;
          out["forward"] = int64_t(rlk::cuda::forward_workspace_bytes(p));
          out["lean"] = int64_t(rlk::cuda::backward_workspace_bytes(p, false, dh));
          out["fast"] = int64_t(rlk::cuda::backward_workspace_bytes(p, true, dh));
#else
          (void)shape_problem(n, h, v, chunk, dtype, has_bias, with_entropy), (void)dhidden_f32;
          for (const char* key : {"forward", "lean", "fast"}) out[key] = int64_t(0);
#endif
          return out;
        },
        nb::arg("n"), nb::arg("h"), nb::arg("v"), nb::arg("chunk"), nb::arg("dtype").noconvert(), nb::arg("has_bias"),
        nb::arg("with_entropy"), nb::arg("dhidden_f32"),
        "CUDA workspace bytes for this problem shape: {'forward', 'lean', 'fast'} (the forward and each backward\n"
        "strategy; the backward's with dhidden in float32, a vocab shard's partial sum, or in the operand dtype).");

  m.def("cuda_lean_plan",
        [](int64_t n, int64_t h, int64_t v, rlk::DType dtype, bool dhidden_f32, bool fused) {
          const rlk::Problem p = shape_problem(n, h, v, v, dtype, false, false);
          const rlk::cuda::LeanPlan plan = rlk::cuda::lean_plan(p, fused, dhidden_f32 ? rlk::DType::kF32 : p.dtype);
          const rlk::cuda::LeanLayout& L = plan.layout;
          nb::dict parts;  // offsets from the tile base, of the parts this path has
          parts["dh"] = int64_t(L.off_dh);
          if (!L.fused) parts["z"] = int64_t(L.off_z);
          parts["dlog"] = int64_t(L.off_dlog);
          if (L.fused) parts["dzz"] = int64_t(L.off_dzz);
          parts["dwacc"] = int64_t(L.off_dwacc);
          nb::dict layout;
          layout["fused"] = L.fused;
          layout["P"] = L.t.P;
          layout["P_max"] = L.t.P_max;
          layout["R"] = L.t.R;
          layout["dwacc"] = int64_t(L.t.dwacc);
          layout["dh_in"] = L.dh_in;
          layout["dh_ws"] = L.dh_ws;
          layout["parts"] = parts;
          layout["cublas_bytes"] = int64_t(rlk::cuda::blas::kWorkspaceAlloc);
          layout["total"] = int64_t(L.total);
          nb::list pieces;
          for (const auto& pc : plan.pieces)
            pieces.append(nb::make_tuple(pc.col, pc.cols, pc.width, pc.borrowed, int64_t(pc.tile_bytes)));
          nb::list sweeps;
          nb::list tiles;
          for (const auto& sw : plan.dh_sweeps) {
            sweeps.append(nb::make_tuple(sw.r0, sw.in, sw.r1));
            tiles.append(nb::make_tuple(sw.tile_rows, sw.tile_width));
          }
          nb::dict out;
          out["workspace_bytes"] = int64_t(L.total);
          out["ws_tile_bytes"] = int64_t(plan.ws_tile_bytes);
          out["rows_per_pass"] = L.t.R;
          out["pieces"] = pieces;
          out["dh_sweeps"] = sweeps;
          out["dh_sweep_tiles"] = tiles;
          out["layout"] = layout;
          return out;
        },
        nb::arg("n"), nb::arg("h"), nb::arg("v"), nb::arg("dtype").noconvert(), nb::arg("dhidden_f32"), nb::arg("fused"),
        "The CUDA lean backward's plan for this shape (host code: in every build; for tests and reports):\n"
        "workspace_bytes, ws_tile_bytes, rows_per_pass, pieces [(col, cols, width, borrowed, tile_bytes)] (the\n"
        "first sweep's), dh_sweeps [(r0, in, r1)]: dH rows [r0, r1), [r0, r0 + in) accumulated inside dhidden;\n"
        "dh_sweep_tiles [(rows, width)]: each sweep's workspace tile; layout: the workspace's layout (P, P_max,\n"
        "R, dwacc, dh_in, dh_ws, parts {name: offset from the tile base}, cublas_bytes: cuBLAS's part before\n"
        "the 256-aligned tile base, total). All zero for n == 0.\n"
        "fused: the sm90 recompute (a device decides it; here it is given).");

  m.def("cuda_prepare_backward", [](int device) {
#if RLK_HAVE_CUDA
    check(rlk::cuda::prepare_backward(device));
#else
    (void)device;
    throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
  }, nb::arg("device"), "Load cuBLAS and create CUDA device `device`'s handle (call before any CUDA-graph capture).");

  m.def("route_counts", [] {
    nb::dict out;
    for (int b = 0; b < int(rlk::Backend::kCount); ++b) {
      const rlk::RouteCounts c = rlk::read_counts(rlk::Backend(b));
      out[rlk::backend_name(rlk::Backend(b))] =
          nb::make_tuple(c.fwd_calls, c.fwd_tokens, c.bwd_calls, c.bwd_tokens, c.bwd_fast_calls);
    }
    return out;
  });
  m.def("reset_route_counts", &rlk::reset_counts);

  m.def("forward", &dl_forward, nb::arg("hidden").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("bias").noconvert().none(), nb::arg("targets").noconvert(), nb::arg("temperature").noconvert(),
        nb::arg("stats").noconvert(), nb::arg("target_logit").noconvert(), nb::arg("logits").noconvert().none(),
        nb::arg("workspace").noconvert().none(),
        nb::arg("vocab_start"), nb::arg("real_vocab"), nb::arg("chunk"), nb::arg("ignore_index"),
        nb::arg("with_entropy"), nb::arg("stream"), nb::arg("logp").noconvert().none() = nb::none(),
        nb::arg("entropy").noconvert().none() = nb::none(), nb::arg("m").noconvert().none() = nb::none(),
        nb::arg("log_s").noconvert().none() = nb::none(), nb::arg("keep").noconvert().none() = nb::none(),
        nb::arg("keep_sum").noconvert().none() = nb::none(), nb::arg("log_s_keep").noconvert().none() = nb::none(),
        "Forward statistics into caller-allocated stats [n, v/chunk, 3] and target_logit [n], and the kept\n"
        "buffer (uint8 [kept_bytes]) when `logits` is given (DLPack). With logp, entropy, m and log_s [n]\n"
        "f32 (a call over the whole vocab) also their combine, as `combine` would. keep: a top-p nucleus,\n"
        "uint8 [n, v_local], with keep_sum [n, v/chunk] f32 (the kept sums) and, combining, log_s_keep [n]:\n"
        "logp is then over the nucleus (target_logit -inf for a target outside it); CPU only.");
  m.def("combine", &dl_combine, nb::arg("stats").noconvert(), nb::arg("target_logit").noconvert(),
        nb::arg("targets").noconvert(), nb::arg("logp").noconvert(), nb::arg("entropy").noconvert(),
        nb::arg("m").noconvert(), nb::arg("log_s").noconvert(), nb::arg("real_vocab"), nb::arg("ignore_index"),
        nb::arg("stream"), nb::arg("keep_sum").noconvert().none() = nb::none(),
        nb::arg("log_s_keep").noconvert().none() = nb::none(),
        "Combine all chunks' statistics into logp, entropy and the row's m and log_s (lse = m + log_s) (DLPack).\n"
        "With keep_sum [n, chunks] (every shard's kept sums) logp is over the nucleus, its log_s_keep [n] out.");
  m.def("backward", &dl_backward, nb::arg("hidden").noconvert(), nb::arg("weight").noconvert(),
        nb::arg("bias").noconvert().none(), nb::arg("targets").noconvert(), nb::arg("temperature").noconvert(),
        nb::arg("m").noconvert(), nb::arg("log_s").noconvert(), nb::arg("entropy").noconvert().none(),
        nb::arg("g").noconvert(),
        nb::arg("e").noconvert().none(), nb::arg("logits").noconvert().none(), nb::arg("dhidden").noconvert(), nb::arg("dweight").noconvert(),
        nb::arg("dbias").noconvert().none(), nb::arg("dtemp").noconvert(), nb::arg("workspace").noconvert().none(),
        nb::arg("vocab_start"), nb::arg("real_vocab"), nb::arg("chunk"), nb::arg("ignore_index"), nb::arg("stream"),
        nb::arg("keep").noconvert().none() = nb::none(), nb::arg("log_s_keep").noconvert().none() = nb::none(),
        "Backward into caller-allocated dhidden (float32, or the dtype of hidden), dweight, dbias f32, dtemp f32\n"
        "(DLPack). With `logits` (the forward's kept buffer) the fast strategy, which on CUDA overwrites it;\n"
        "else lean. keep (the forward's nucleus) and log_s_keep (the combine's): the nucleus's logp gradient.");
}
