// _rlk_core: the one compiled module both frontends import. It exports the XLA FFI handler
// capsules (for rlk_xla), the DLPack entry points (for torch_bridge), the canonical chunk rule,
// workspace sizes and the route counters.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <stdexcept>

#include "dispatch.h"
#include "lean_plan.h"
#include "rlk/linear_logp.h"

#if RLK_HAVE_XLA_FFI
#include "xla/ffi/api/c_api.h"
// handlers_cpu.cc and handlers_cuda.cc: each platform's three targets (handlers.h).
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

#include "exec.h"
#include "io.h"

namespace nb = nanobind;

namespace {

#if RLK_HAVE_XLA_FFI
using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// One platform's FFI targets, by the names the frontend calls them.
nb::dict targets(Handler* forward, Handler* combine, Handler* backward) {
  nb::dict d;
  const std::pair<const char*, Handler*> named[] = {
      {"rlk_forward", forward}, {"rlk_combine", combine}, {"rlk_backward", backward}};
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
// Keyword arguments only: a stage's buffers by their names in its table (io.h), None or absent for
// one not given, and the attributes of io::Attrs by name. Arrays arrive through DLPack (nb::ndarray,
// no conversion: a wrong dtype or layout is an error, never a silent copy). Outputs and scratch are
// allocated by the caller (torch's allocator); the CUDA calls run on the caller's `stream`. The
// checks, the Problem and the run are io.h's, the XLA FFI handlers' own.
using Array = nb::ndarray<nb::c_contig>;

rlk::io::Elem elem_of(const Array& a) {
  using rlk::io::Elem;
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return Elem::kF32;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return Elem::kBF16;
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return Elem::kF16;
  if (t == nb::dtype<int32_t>()) return Elem::kS32;
  if (t == nb::dtype<uint8_t>()) return Elem::kU8;
  return Elem::kOther;
}

// io's Attrs by name (RLK_ATTRS), and the CUDA stream. A DLPack call knows has_bias from its bias,
// and the backward with_entropy from its entropy and e: what it passes of those is overridden.
#define RLK_ATTR_ENTRY(name) \
  std::pair<const char*, int64_t rlk::io::Attrs::*> { #name, &rlk::io::Attrs::name }
constexpr std::pair<const char*, int64_t rlk::io::Attrs::*> kAttrs[] = {RLK_ATTRS(RLK_ATTR_ENTRY)};

struct DlCall {
  rlk::io::Attrs at{0, 0, 0, -100, 0, 0};
  uintptr_t stream = 0;
};

// Buffer `name` of io, by its table; false if the table has none.
template <class IO>
bool fill_buffer(IO& io, const char* name, nb::handle v) {
  for (const auto& f : rlk::io::fields<IO>()) {
    if (!(f.flags & rlk::io::kDl) || std::strcmp(f.name, name) != 0) continue;
    if (v.is_none()) return true;
    Array a;
    if (!nb::try_cast(v, a, /*convert=*/false))
      throw std::invalid_argument(std::string("rlk: ") + f.name + " must be a C-contiguous array (DLPack)");
    rlk::io::Buf& b = io.*f.member;
    b.given = true;
    b.elem = elem_of(a);
    for (size_t d = 0; d < a.ndim(); ++d) b.dims.push_back(int64_t(a.shape(d)));
    b.data = static_cast<char*>(a.data());
    b.elem_bytes = a.itemsize();
    b.device = a.device_type();
    return true;
  }
  return false;
}

// One pass over the keyword arguments: each an attribute, the stream or a buffer of the table.
template <class IO>
DlCall from_kwargs(IO& io, const nb::kwargs& kw) {
  DlCall c;
  for (const auto& [key, v] : kw) {
    const char* name = nb::borrow<nb::str>(key).c_str();
    if (std::strcmp(name, "stream") == 0) {
      c.stream = nb::cast<uintptr_t>(v);
      continue;
    }
    const auto attr = std::find_if(std::begin(kAttrs), std::end(kAttrs),
                                   [&](const auto& e) { return std::strcmp(e.first, name) == 0; });
    if (attr != std::end(kAttrs))
      c.at.*attr->second = nb::isinstance<nb::bool_>(v) ? int64_t(nb::cast<bool>(v)) : nb::cast<int64_t>(v);
    else if (!fill_buffer(io, name, v))
      throw std::invalid_argument(std::string("rlk: unknown keyword argument ") + name + " (the stage's table, io.h)");
  }
  if (rlk::io::Fail f = rlk::io::split_all(io)) throw std::invalid_argument(f.what);
  return c;
}

// Run the stage on the executor of `device` (its arrays' device type): the XLA FFI's executors.
template <class IO>
void run_dl(IO& io, const DlCall& c, int device) {
  auto raise = [](const rlk::io::Fail& f) {
    if (f.kind == rlk::io::Fail::kInvalid) throw std::invalid_argument(f.what);
    if (f) throw std::runtime_error(f.what);
  };
  if (device == nb::device::cpu::value) {
    rlk::io::Fail f;
    {
      nb::gil_scoped_release nogil;
      rlk::CpuExec ex;
      f = rlk::io::run(ex, io, c.at, /*batched=*/false);
    }
    return raise(f);
  }
  if (device != nb::device::cuda::value)
    throw std::invalid_argument("rlk: tensors must be on the CPU or a CUDA device");
#if RLK_HAVE_CUDA
  rlk::CudaExec ex{reinterpret_cast<cudaStream_t>(c.stream)};
  raise(rlk::io::run(ex, io, c.at, /*batched=*/false));
#else
  (void)c;
  throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
}

void dl_forward(const nb::kwargs& kw) {
  rlk::io::ForwardIO io;
  DlCall c = from_kwargs(io, kw);
  c.at.has_bias = io.bias.given;
  run_dl(io, c, io.hidden.device);
}

void dl_combine(const nb::kwargs& kw) {
  rlk::io::CombineIO io;
  const DlCall c = from_kwargs(io, kw);
  run_dl(io, c, io.stats.device);
}

void dl_backward(const nb::kwargs& kw) {
  rlk::io::BackwardIO io;
  DlCall c = from_kwargs(io, kw);
  c.at.has_bias = io.bias.given;
  c.at.with_entropy = io.entropy.given && io.e.given;
  run_dl(io, c, io.hidden.device);
}

// The saved logits' bytes on a device (nb::device::cpu or cuda) for this problem.
size_t saved_logits_bytes_on(int device, const rlk::Problem& p) {
  if (device == nb::device::cpu::value) return rlk::cpu::saved_logits_bytes(p);
#if RLK_HAVE_CUDA
  return rlk::cuda::saved_logits_bytes(p);
#else
  throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
}

void check(rlk::Status s) {
  if (s) throw std::runtime_error(s);
}

// ---- What this build supports ------------------------------------------------------------------
#ifndef RLK_HAVE_SM90
#define RLK_HAVE_SM90 0
#endif
constexpr const char* kNoCuda =
    "this build of _rlk_core has no CUDA backend (built without nvcc, or with RLK_CUDA=OFF)";

// A kernel (a route counter's name) and why it cannot run, "" if it can (as far as the build knows:
// the CUDA forward's sm90-or-portable choice is made per call, on the device, by forward_backend).
// A stage's XLA FFI operands in call order, as (name, rank) from its table (io.h): the JAX
// frontend builds its calls from this, so an operand added to a table reaches it by name.
template <class IO>
nb::list ffi_operands() {
  nb::list out;
  for (const auto& f : rlk::io::fields<IO>())
    if ((f.flags & rlk::io::kFfi) && (f.flags & rlk::io::kIn)) out.append(nb::make_tuple(f.name, f.core_rank));
  return out;
}

nb::dict kernel(const char* reason_if_not, bool built) {
  nb::dict k;
  k["supported"] = built;
  k["reason"] = built ? nb::object(nb::none()) : nb::object(nb::str(reason_if_not));
  return k;
}

// One platform: its name in each frontend and what of it this build runs, with the reasons.
nb::dict platform(const char* name, const char* xla, const char* jax_backend, const char* jax_lowering,
                  int dlpack_device, bool workspace, bool built, const char* reason_if_not, nb::dict kernels) {
  nb::dict d;
  d["name"] = name;                  // saved_logits_bytes' device, rlk_common's key; torch's device type
  d["xla_platform"] = xla;           // jax.ffi.register_ffi_target's platform
  d["jax_backend"] = jax_backend;    // jax.default_backend() on it
  d["jax_lowering"] = jax_lowering;  // lax.platform_dependent's keyword
  d["dlpack_device"] = dlpack_device;
  d["workspace"] = workspace;        // its calls take scratch of cuda_workspace_bytes
  d["supported"] = built;
  d["reason"] = built ? nb::object(nb::none()) : nb::object(nb::str(reason_if_not));
  d["kernels"] = kernels;
  return d;
}

// cuda_device: also the architecture test of that device (the sm90 kernel's; cuda/dispatch.cc).
nb::dict platforms(std::optional<int> cuda_device) {
  nb::dict cpu_kernels, cuda_kernels, out;
  cpu_kernels[rlk::backend_name(rlk::Backend::kCpu)] = kernel("", true);
#if RLK_HAVE_CUDA
  const char* no_sm90 = cuda_device ? rlk::cuda::sm90_unsupported(*cuda_device)
                                    : (RLK_HAVE_SM90 ? nullptr : rlk::cuda::sm90_unsupported(0));
#else
  (void)cuda_device;
  const char* no_sm90 = kNoCuda;
#endif
  cuda_kernels[rlk::backend_name(rlk::Backend::kCudaSm90)] = kernel(no_sm90 ? no_sm90 : "", !no_sm90);
  cuda_kernels[rlk::backend_name(rlk::Backend::kCudaPortable)] = kernel(kNoCuda, RLK_HAVE_CUDA);
  cuda_kernels[rlk::backend_name(rlk::Backend::kCudaBlas)] = kernel(kNoCuda, RLK_HAVE_CUDA);
  out["cpu"] = platform("cpu", "cpu", "cpu", "cpu", nb::device::cpu::value, false, true, "", cpu_kernels);
  out["cuda"] =
      platform("cuda", "CUDA", "gpu", "cuda", nb::device::cuda::value, true, RLK_HAVE_CUDA, kNoCuda, cuda_kernels);
  return out;
}

// The DLPack device of a platform named as platforms() names it, else ValueError.
int device_of(const std::string& name) {
  if (name == "cpu") return nb::device::cpu::value;
  if (name == "cuda") return nb::device::cuda::value;
  throw std::invalid_argument("rlk: unknown platform '" + name + "' (platforms(): 'cpu', 'cuda')");
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
    out["cpu"] = targets(RlkForwardCpu, RlkCombineCpu, RlkBackwardCpu);
#if RLK_HAVE_CUDA
    out["CUDA"] = targets(RlkForwardCuda, RlkCombineCuda, RlkBackwardCuda);
#endif
#endif
    return out;
  });

  m.def(
      "ffi_operands",
      [] {
        nb::dict out;
        out["forward"] = ffi_operands<rlk::io::ForwardIO>();
        out["combine"] = ffi_operands<rlk::io::CombineIO>();
        out["backward"] = ffi_operands<rlk::io::BackwardIO>();
        return out;
      },
      "Each stage's XLA FFI operands in call order: {stage: [(name, rank), ...]} (ffi/io.h's tables).");

  m.def("platforms", &platforms, nb::arg("cuda_device") = nb::none(),
        "The platforms this module knows, by name ('cpu', 'cuda'): each one's names in XLA, jax and DLPack,\n"
        "whether this build runs it (supported) and why not (reason), whether its calls take a workspace, and\n"
        "its kernels {route counter name: {supported, reason}}; with cuda_device (an index), the sm90\n"
        "kernel's architecture test on that device too (per problem, forward_backend also needs bf16/fp16, h\n"
        "a multiple of 64 and no nucleus). The frontends ask this instead of naming devices themselves.");

  m.def(
      "saved_logits_bytes",
      [](int64_t n, int64_t v, int64_t chunk, rlk::DType dtype, const std::string& device) {
        const int dev = device_of(device);
        if (!rlk::io::chunk_fits(v, chunk)) throw std::invalid_argument(rlk::io::invalid(rlk::io::kChunkRule).what);
        const rlk::Problem p = shape_problem(n, 0, v, chunk, dtype, false, false);
        return int64_t(saved_logits_bytes_on(dev, p));
      },
      nb::arg("n"), nb::arg("v"), nb::arg("chunk"), nb::arg("dtype").noconvert(), nb::arg("device"),
      "Bytes of the fast backward's saved logits (uint8) on platform `device` ('cpu' or 'cuda') for this\n"
      "problem shape: each backend saves what its backward reads, in its own layout.");

  m.def(
      "cuda_workspace_bytes",
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

  m.def(
      "cuda_lean_plan",
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

  m.def(
      "cuda_prepare_backward",
      [](int device) {
#if RLK_HAVE_CUDA
        check(rlk::cuda::prepare_backward(device));
#else
        (void)device;
        throw std::invalid_argument("rlk: this build has no CUDA backend");
#endif
      },
      nb::arg("device"), "Load cuBLAS and create CUDA device `device`'s handle (call before any CUDA-graph capture).");

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

  m.def("forward", &dl_forward,
        "Forward statistics (DLPack; keyword arguments, io.h's ForwardIO by name): stats [n, v/chunk, 3] f32\n"
        "and target_logit [n] f32 into the caller's buffers, and with saved_logits (uint8 [saved_logits_bytes]) the\n"
        "fast backward's record. With logp, entropy, m and log_s [n] f32 (a call over the whole vocab) also\n"
        "their combine, as `combine` would. keep: a top-p nucleus, uint8 [n, v_local], with keep_sum\n"
        "[n, v/chunk] f32 (the kept sums) and, combining, log_s_keep [n]: logp is then over the nucleus\n"
        "(target_logit -inf for a target outside it). Attributes: vocab_start, real_vocab, chunk,\n"
        "ignore_index, with_entropy; stream (CUDA); workspace: CUDA scratch (cuda_workspace_bytes).");
  m.def("combine", &dl_combine,
        "Combine all chunks' statistics into logp, entropy and the row's m and log_s (lse = m + log_s) (DLPack;\n"
        "keyword arguments, io.h's CombineIO by name). With keep_sum [n, chunks] (every shard's kept sums)\n"
        "logp is over the nucleus, its log_s_keep [n] out. Attributes: real_vocab, ignore_index; stream.");
  m.def("backward", &dl_backward,
        "Backward (DLPack; keyword arguments, io.h's BackwardIO by name) into the caller's dhidden (float32, or\n"
        "the dtype of hidden), dweight, dbias f32 (with bias), dtemp f32. With saved_logits (the forward's\n"
        "record) the fast strategy, which on CUDA overwrites it; else lean. entropy and e: the entropy's\n"
        "gradient. keep (the forward's nucleus) and log_s_keep (the combine's): the nucleus's logp gradient.\n"
        "Attributes: vocab_start, real_vocab, chunk, ignore_index; stream; workspace (cuda_workspace_bytes).");
}
