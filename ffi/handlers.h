// The XLA FFI handler bodies, shared by the "cpu" and "CUDA" platforms. A platform supplies an
// executor with forward / combine / backward over the plain API; everything else — reading
// buffers, checking shapes, building the Problem, and vmap's leading batch dimensions
// (vmap_method="expand_dims": an operand that is not batched has size-1 leading dimensions) — is
// here once.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "rlk/linear_logp.h"
#include "xla/ffi/api/ffi.h"

namespace rlk::ffi_handlers {

namespace ffi = xla::ffi;

inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

// An operand seen as [leading..., core...] with `core_rank` trailing dimensions.
struct View {
  std::vector<int64_t> lead, core;
  char* data;
  size_t elem_bytes;
  int64_t core_elems() const {
    int64_t e = 1;
    for (int64_t d : core) e *= d;
    return e;
  }
};

template <class Buf>
View view(const Buf& b, int core_rank) {
  auto dims = b.dimensions();
  View v;
  const int rank = int(dims.size());
  for (int i = 0; i < rank; ++i) (i < rank - core_rank ? v.lead : v.core).push_back(dims[i]);
  while (int(v.core.size()) < core_rank) v.core.insert(v.core.begin(), 1);
  v.data = static_cast<char*>(b.untyped_data());
  v.elem_bytes = ffi::ByteWidth(b.element_type());
  return v;
}

// Batch iteration over the leading dimensions of the outputs; inputs broadcast where theirs are 1.
struct Batch {
  std::vector<int64_t> lead;
  int64_t count = 1;

  explicit Batch(const std::vector<int64_t>& out_lead) : lead(out_lead) {
    for (int64_t d : lead) count *= d;
  }
  bool fits(const View& v) const {
    if (v.lead.size() != lead.size()) return false;
    for (size_t i = 0; i < lead.size(); ++i)
      if (v.lead[i] != 1 && v.lead[i] != lead[i]) return false;
    return true;
  }
  bool full(const View& v) const { return v.lead == lead; }
  bool single(const View& v) const {
    for (int64_t d : v.lead)
      if (d != 1) return false;
    return true;
  }
  // Pointer to batch item b of v.
  template <class T = void>
  T* at(const View& v, int64_t b) const {
    int64_t off = 0, stride = v.core_elems();
    for (int i = int(lead.size()) - 1; i >= 0; --i) {
      const int64_t idx = b % lead[i];
      b /= lead[i];
      if (v.lead[i] != 1) off += idx * stride;
      stride *= v.lead[i];
    }
    return reinterpret_cast<T*>(v.data + off * int64_t(v.elem_bytes));
  }
};

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "rlk: " + what);
}
inline ffi::Error from_status(Status s) {
  return s ? ffi::Error(ffi::ErrorCode::kInternal, s) : ffi::Error::Success();
}

// ---- Buffer checks: every operand and result against the others, before anything is read or
// written (the targets are in XLA's global registry: any caller may hand them any buffers).
// A buffer is [lead..., core...]: its trailing dimensions must equal `core` and its leading ones
// the batch's (inputs may broadcast a leading dimension of 1, results may not).
constexpr int64_t kAny = -1;  // a core dimension not checked here (checked against another buffer)

inline std::string shape_str(const std::vector<int64_t>& lead, const std::vector<int64_t>& core) {
  std::string s = "(";
  for (int64_t d : lead) s += std::to_string(d) + ", ";
  for (int64_t d : core) s += std::to_string(d) + ", ";
  if (s.size() > 1) s.resize(s.size() - 2);
  return s + ")";
}

inline std::string dtype_str(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    default: return "XLA DataType " + std::to_string(int(t));
  }
}

struct Expect {
  const char* name;
  ffi::DataType got;
  ffi::DataType want;
  std::vector<int64_t> dims;  // actual dimensions of the buffer
  std::vector<int64_t> core;  // expected trailing dimensions (kAny: any)
  bool result;                // a result: its leading dimensions must be the batch's exactly
};

template <class Buf>
Expect expect(const char* name, const Buf& b, ffi::DataType want, std::vector<int64_t> core, bool result = false) {
  auto d = b.dimensions();
  return {name, b.element_type(), want, std::vector<int64_t>(d.begin(), d.end()), std::move(core), result};
}

inline ffi::Error check_buffers(const std::vector<int64_t>& batch, std::initializer_list<Expect> all) {
  for (const Expect& x : all) {
    const size_t rank = batch.size() + x.core.size();
    bool ok = x.got == x.want && x.dims.size() == rank;
    for (size_t i = 0; ok && i < rank; ++i) {
      const int64_t want = i < batch.size() ? batch[i] : x.core[i - batch.size()];
      ok = want == kAny || x.dims[i] == want || (i < batch.size() && !x.result && x.dims[i] == 1);
    }
    if (!ok)
      return invalid(std::string(x.name) + " must be " + shape_str(batch, x.core) + " " + dtype_str(x.want) +
                     " (-1: any size), got " + shape_str({}, x.dims) + " " + dtype_str(x.got));
  }
  return ffi::Error::Success();
}

// The batch (leading dimensions) of a call: those of `result` beyond its `core_rank` trailing ones.
template <class Buf>
ffi::Error batch_of(const char* name, const Buf& result, size_t core_rank, std::vector<int64_t>* batch) {
  auto d = result.dimensions();
  if (d.size() < core_rank)
    return invalid(std::string(name) + " has rank " + std::to_string(d.size()) + ", below its " +
                   std::to_string(core_rank) + " core dimensions");
  batch->assign(d.begin(), d.end() - core_rank);
  return ffi::Error::Success();
}

// The operands forward and backward share, from hidden's and weight's shapes: [n, h] and [v, h].
struct Sizes {
  int64_t n, h, v;
  ffi::DataType dtype;
};

template <class Buf>
ffi::Error sizes_of(const Buf& hidden, const Buf& weight, Sizes* s) {
  auto hd = hidden.dimensions(), wd = weight.dimensions();
  if (hd.size() < 2 || wd.size() < 2) return invalid("hidden must be [..., n, h] and weight [..., v, h]");
  DType t;
  if (!to_dtype(hidden.element_type(), &t)) return invalid("hidden must be float32, float16 or bfloat16");
  *s = {hd[hd.size() - 2], hd[hd.size() - 1], wd[wd.size() - 2], hidden.element_type()};
  return ffi::Error::Success();
}

inline std::vector<int64_t> vec_or_empty(bool present, int64_t d) {
  return present ? std::vector<int64_t>{d} : std::vector<int64_t>{0};
}

// forward's operands and results: stats [n, v / chunk, kStatWidth] f32, target_logit [n] f32.
// (The kept logits, when present, are checked by forward itself.)
inline ffi::Error check_forward(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                                ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer>& stats,
                                ffi::Result<ffi::AnyBuffer>& target_logit, int64_t chunk, int64_t has_bias) {
  Sizes s;
  std::vector<int64_t> batch;
  if (auto e = sizes_of(hidden, weight, &s); e.failure()) return e;
  if (auto e = batch_of("stats", *stats, 3, &batch); e.failure()) return e;
  if (chunk <= 0 || s.v % chunk != 0) return invalid("chunk must be > 0 and divide the local vocab");
  using DT = ffi::DataType;
  return check_buffers(batch, {expect("hidden", hidden, s.dtype, {s.n, s.h}),
                               expect("weight", weight, s.dtype, {s.v, s.h}),
                               has_bias ? expect("bias", bias, DT::F32, {s.v}) : expect("bias", bias, bias.element_type(), {kAny}),
                               expect("targets", targets, DT::S32, {s.n}),
                               expect("temperature", temperature, DT::F32, {s.n}),
                               expect("stats", *stats, DT::F32, {s.n, s.v / chunk, kStatWidth}, true),
                               expect("target_logit", *target_logit, DT::F32, {s.n}, true)});
}

// combine: stats [n, k, kStatWidth] f32, target_logit [n] f32, targets [n] s32 -> 4 x [n] f32.
inline ffi::Error check_combine(ffi::AnyBuffer stats, ffi::AnyBuffer target_logit, ffi::AnyBuffer targets,
                                ffi::Result<ffi::AnyBuffer>& logp, ffi::Result<ffi::AnyBuffer>& entropy,
                                ffi::Result<ffi::AnyBuffer>& m, ffi::Result<ffi::AnyBuffer>& log_s) {
  std::vector<int64_t> batch;
  if (auto e = batch_of("logp", *logp, 1, &batch); e.failure()) return e;
  auto sd = stats.dimensions();
  if (sd.size() < 3) return invalid("stats must be [..., n, k, " + std::to_string(kStatWidth) + "]");
  const int64_t n = sd[sd.size() - 3], k = sd[sd.size() - 2];
  using DT = ffi::DataType;
  return check_buffers(batch, {expect("stats", stats, DT::F32, {n, k, kStatWidth}),
                               expect("target_logit", target_logit, DT::F32, {n}),
                               expect("targets", targets, DT::S32, {n}),
                               expect("logp", *logp, DT::F32, {n}, true),
                               expect("entropy", *entropy, DT::F32, {n}, true), expect("m", *m, DT::F32, {n}, true),
                               expect("log_s", *log_s, DT::F32, {n}, true)});
}

// backward: m, log_s, g [n] f32; entropy, e [n] f32 with entropy, else anything; results dhidden
// [n, h] (f32 or the operand dtype), dweight [v, h] operand dtype, dbias [v] f32 with a bias else
// [0], dtemp [n] f32. (The kept logits, when present, are checked by backward itself.)
inline ffi::Error check_backward(ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias, ffi::AnyBuffer targets,
                                 ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s,
                                 ffi::AnyBuffer entropy, ffi::AnyBuffer g,
                                 ffi::AnyBuffer e, ffi::Result<ffi::AnyBuffer>& dhidden,
                                 ffi::Result<ffi::AnyBuffer>& dweight, ffi::Result<ffi::AnyBuffer>& dbias,
                                 ffi::Result<ffi::AnyBuffer>& dtemp, int64_t chunk, int64_t has_bias,
                                 int64_t with_entropy) {
  Sizes s;
  std::vector<int64_t> batch;
  if (auto err = sizes_of(hidden, weight, &s); err.failure()) return err;
  if (auto err = batch_of("dhidden", *dhidden, 2, &batch); err.failure()) return err;
  if (chunk <= 0 || s.v % chunk != 0) return invalid("chunk must be > 0 and divide the local vocab");
  using DT = ffi::DataType;
  const DT dh_want = (*dhidden).element_type() == DT::F32 ? DT::F32 : s.dtype;
  auto optional_row = [&](const char* name, ffi::AnyBuffer b) {
    return with_entropy ? expect(name, b, DT::F32, {s.n}) : expect(name, b, b.element_type(), {kAny});
  };
  return check_buffers(batch, {expect("hidden", hidden, s.dtype, {s.n, s.h}),
                               expect("weight", weight, s.dtype, {s.v, s.h}),
                               has_bias ? expect("bias", bias, DT::F32, {s.v}) : expect("bias", bias, bias.element_type(), {kAny}),
                               expect("targets", targets, DT::S32, {s.n}),
                               expect("temperature", temperature, DT::F32, {s.n}),
                               expect("m", m, DT::F32, {s.n}), expect("log_s", log_s, DT::F32, {s.n}),
                               optional_row("entropy", entropy),
                               expect("g", g, DT::F32, {s.n}), optional_row("e", e),
                               expect("dhidden", *dhidden, dh_want, {s.n, s.h}, true),
                               expect("dweight", *dweight, s.dtype, {s.v, s.h}, true),
                               expect("dbias", *dbias, DT::F32, {has_bias ? s.v : 0}, true),
                               expect("dtemp", *dtemp, DT::F32, {s.n}, true)});
}

// The attributes of forward and backward, in binding order.
#define RLK_PROBLEM_ATTRS                                                                        \
  .Attr<int64_t>("vocab_start").Attr<int64_t>("real_vocab").Attr<int64_t>("chunk")               \
      .Attr<int64_t>("ignore_index").Attr<int64_t>("has_bias").Attr<int64_t>("with_entropy")

struct Attrs {
  int64_t vocab_start, real_vocab, chunk, ignore_index, has_bias, with_entropy;
};

// Operands of forward and backward that describe the problem.
struct Inputs {
  View hidden, weight, bias, targets, temperature;
};

inline ffi::Error make_problem(const Inputs& in, ffi::DataType ht, ffi::DataType wt, ffi::DataType bt,
                               const Attrs& at, Problem* p) {
  if (ht != wt) return invalid("hidden and weight dtypes differ");
  if (!to_dtype(ht, &p->dtype)) return invalid("dtype must be float32, float16 or bfloat16");
  p->n = in.hidden.core[0];
  p->h = in.hidden.core[1];
  p->v = in.weight.core[0];
  if (in.weight.core[1] != p->h) return invalid("hidden and weight disagree on the hidden size");
  if (in.targets.core[0] != p->n || in.temperature.core[0] != p->n) return invalid("row counts disagree");
  p->has_bias = at.has_bias != 0;
  if (p->has_bias && (bt != ffi::DataType::F32 || in.bias.core[0] != p->v)) return invalid("bias must be [v] float32");
  p->vocab_start = at.vocab_start;
  p->real_vocab = at.real_vocab;
  p->chunk = at.chunk;
  p->ignore_index = at.ignore_index;
  p->with_entropy = at.with_entropy != 0;
  if (p->chunk <= 0 || p->v % p->chunk != 0) return invalid("chunk must divide the local vocab");
  return ffi::Error::Success();
}

// The kept buffer: bytes (any dtype) of one batch item, at least the executor's kept_bytes (a
// frontend that does not know the platform at trace time may give more).
template <class Exec>
bool is_kept_of(const View& v, const Problem& p, const Exec& ex) {
  return int64_t(v.core_elems() * v.elem_bytes) >= int64_t(ex.kept_bytes(p));
}

// forward: (hidden, weight, bias, targets, temperature) -> (stats, target_logit[, kept bytes])
template <class Exec>
ffi::Error forward(Exec& ex, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                   ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::Result<ffi::AnyBuffer> stats,
                   ffi::Result<ffi::AnyBuffer> target_logit, std::optional<View> kept, const Attrs& at) {
  if (auto e = check_forward(hidden, weight, bias, targets, temperature, stats, target_logit, at.chunk, at.has_bias);
      e.failure())
    return e;
  Inputs in{view(hidden, 2), view(weight, 2), view(bias, 1), view(targets, 1), view(temperature, 1)};
  Problem p;
  if (auto e = make_problem(in, hidden.element_type(), weight.element_type(), bias.element_type(), at, &p);
      e.failure())
    return e;
  const View st = view(*stats, 3), tl = view(*target_logit, 1);
  const Batch batch(st.lead);
  for (const View* v : std::initializer_list<const View*>{&in.hidden, &in.weight, &in.bias, &in.targets, &in.temperature})
    if (!batch.fits(*v)) return invalid("unsupported batching of the operands");
  if (kept && (!batch.full(*kept) || !is_kept_of(*kept, p, ex)))
    return invalid("the kept buffer must hold kept_bytes(problem) bytes per batch item");
  // Rows are independent: with one shared weight and every row operand batched alike, the batch
  // folds into the rows (the same bits as a loop, since results are batch invariant).
  const bool fold = batch.single(in.weight) && batch.single(in.bias) && batch.full(in.hidden) &&
                    batch.full(in.targets) && batch.full(in.temperature);
  const int64_t items = fold ? 1 : batch.count;
  if (fold) p.n *= batch.count;
  for (int64_t b = 0; b < items; ++b) {
    FwdArgs a;
    a.hidden = batch.at(in.hidden, b);
    a.weight = batch.at(in.weight, b);
    a.bias = p.has_bias ? batch.at<const float>(in.bias, b) : nullptr;
    a.targets = batch.at<const int32_t>(in.targets, b);
    a.temperature = batch.at<const float>(in.temperature, b);
    a.stats = batch.at<float>(st, b);
    a.target_logit = batch.at<float>(tl, b);
    a.logits = kept ? batch.at(*kept, b) : nullptr;
    if (auto e = from_status(ex.forward(p, a)); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// combine: (stats, target_logit, targets) -> (logp, entropy, m, log_s)
template <class Exec>
ffi::Error combine(Exec& ex, ffi::AnyBuffer stats, ffi::AnyBuffer target_logit, ffi::AnyBuffer targets,
                   ffi::Result<ffi::AnyBuffer> logp, ffi::Result<ffi::AnyBuffer> entropy,
                   ffi::Result<ffi::AnyBuffer> m, ffi::Result<ffi::AnyBuffer> log_s, int64_t real_vocab,
                   int64_t ignore_index) {
  if (auto e = check_combine(stats, target_logit, targets, logp, entropy, m, log_s); e.failure()) return e;
  const View st = view(stats, 3), tl = view(target_logit, 1), tg = view(targets, 1);
  const View lp = view(*logp, 1), en = view(*entropy, 1), vm = view(*m, 1), vls = view(*log_s, 1);
  const Batch batch(lp.lead);
  for (const View* v : std::initializer_list<const View*>{&st, &tl, &tg})
    if (!batch.fits(*v)) return invalid("unsupported batching of the operands");
  const bool fold = batch.full(st) && batch.full(tl) && batch.full(tg);
  CombineArgs a;
  a.n = st.core[0] * (fold ? batch.count : 1);
  a.k = st.core[1];
  a.real_vocab = real_vocab;
  a.ignore_index = ignore_index;
  for (int64_t b = 0; b < (fold ? 1 : batch.count); ++b) {
    a.stats = batch.at<const float>(st, b);
    a.target_logit = batch.at<const float>(tl, b);
    a.targets = batch.at<const int32_t>(tg, b);
    a.logp = batch.at<float>(lp, b);
    a.entropy = batch.at<float>(en, b);
    a.m = batch.at<float>(vm, b);
    a.log_s = batch.at<float>(vls, b);
    if (auto e = from_status(ex.combine(a)); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// backward: (hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e[, kept bytes])
//        -> (dhidden f32 or dtype, dweight, dbias f32, dtemp f32). The fast variant's kept buffer comes as a
//        result aliased to the operand (the backend may overwrite it), hence a View here.
template <class Exec>
ffi::Error backward(Exec& ex, ffi::AnyBuffer hidden, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                    ffi::AnyBuffer targets, ffi::AnyBuffer temperature, ffi::AnyBuffer m, ffi::AnyBuffer log_s,
                    ffi::AnyBuffer entropy,
                    ffi::AnyBuffer g, ffi::AnyBuffer e, std::optional<View> kept, ffi::Result<ffi::AnyBuffer> dhidden,
                    ffi::Result<ffi::AnyBuffer> dweight, ffi::Result<ffi::AnyBuffer> dbias,
                    ffi::Result<ffi::AnyBuffer> dtemp, const Attrs& at) {
  if (auto err = check_backward(hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, dhidden, dweight, dbias,
                                dtemp, at.chunk, at.has_bias, at.with_entropy);
      err.failure())
    return err;
  Inputs in{view(hidden, 2), view(weight, 2), view(bias, 1), view(targets, 1), view(temperature, 1)};
  Problem p;
  if (auto err = make_problem(in, hidden.element_type(), weight.element_type(), bias.element_type(), at, &p);
      err.failure())
    return err;
  const View vm = view(m, 1), vls = view(log_s, 1), ve = view(entropy, 1), vg = view(g, 1), vee = view(e, 1);
  const View dh = view(*dhidden, 2), dw = view(*dweight, 2), db = view(*dbias, 1), dt = view(*dtemp, 1);
  DType dh_dtype;  // which of f32 and the operand dtype: the backend checks
  if (!to_dtype(dhidden->element_type(), &dh_dtype)) return invalid("dhidden must be float32 or the dtype of hidden");
  const Batch batch(dh.lead);
  for (const View* v : std::initializer_list<const View*>{&in.hidden, &in.weight, &in.bias, &in.targets, &in.temperature, &vm, &vls, &ve, &vg, &vee})
    if (!batch.fits(*v)) return invalid("unsupported batching of the operands");
  if (kept && (!batch.full(*kept) || !is_kept_of(*kept, p, ex)))
    return invalid("the kept buffer must hold kept_bytes(problem) bytes per batch item");
  for (int64_t b = 0; b < batch.count; ++b) {
    BwdArgs a;
    a.hidden = batch.at(in.hidden, b);
    a.weight = batch.at(in.weight, b);
    a.bias = p.has_bias ? batch.at<const float>(in.bias, b) : nullptr;
    a.targets = batch.at<const int32_t>(in.targets, b);
    a.temperature = batch.at<const float>(in.temperature, b);
    a.m = batch.at<const float>(vm, b);
    a.log_s = batch.at<const float>(vls, b);
    a.entropy = p.with_entropy ? batch.at<const float>(ve, b) : nullptr;
    a.g = batch.at<const float>(vg, b);
    a.e = p.with_entropy ? batch.at<const float>(vee, b) : nullptr;
    a.logits = kept ? batch.at(*kept, b) : nullptr;
    a.dhidden = batch.at(dh, b);
    a.dhidden_dtype = dh_dtype;
    a.dweight = batch.at(dw, b);
    a.dbias = p.has_bias ? batch.at<float>(db, b) : nullptr;
    a.dtemp = batch.at<float>(dt, b);
    if (auto err = from_status(ex.backward(p, a)); err.failure()) return err;
  }
  return ffi::Error::Success();
}

}  // namespace rlk::ffi_handlers
