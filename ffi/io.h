// The calls' buffers as both entry points see them, and the one path from them to the plain API:
// fill an IO struct (the XLA FFI handlers from their operands and results, the DLPack entry points
// from their keyword arguments), check it (every rule once, here), build the Problem and run the
// stage on an executor (exec.h). No XLA and no nanobind types here.
//
// A stage's buffers are one table (fields<IO>()): name, role, which entry points pass it, and its
// core rank. The XLA FFI handlers take the table's kFfi fields in order (operands, then results);
// the DLPack entry points take its kDl fields by name. XLA's vmap ("expand_dims") gives buffers
// leading batch dimensions: a buffer is [lead..., core...], inputs may broadcast a leading dimension
// of 1, results may not. DLPack calls have no batch.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "rlk/linear_logp.h"

namespace rlk::io {

enum class Elem : int32_t { kF32, kF16, kBF16, kS32, kU8, kOther };

inline const char* elem_name(Elem e) {
  switch (e) {
    case Elem::kF32: return "float32";
    case Elem::kF16: return "float16";
    case Elem::kBF16: return "bfloat16";
    case Elem::kS32: return "int32";
    case Elem::kU8: return "uint8";
    default: return "an unsupported dtype";
  }
}

inline bool to_dtype(Elem e, DType* out) {
  switch (e) {
    case Elem::kF32: *out = DType::kF32; return true;
    case Elem::kF16: *out = DType::kF16; return true;
    case Elem::kBF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

// One buffer of a call: absent (a DLPack None) or [lead..., core...].
struct Buf {
  bool given = false;
  Elem elem = Elem::kOther;
  std::vector<int64_t> dims;        // as passed
  std::vector<int64_t> lead, core;  // dims split at the field's core rank (split())
  char* data = nullptr;
  size_t elem_bytes = 0;
  int device = 0;  // DLPack's device type; 0 in the XLA FFI (XLA places the buffers)

  int64_t core_elems() const {
    int64_t e = 1;
    for (int64_t d : core) e *= d;
    return e;
  }
  int64_t core_bytes() const { return core_elems() * int64_t(elem_bytes); }
  bool split(int core_rank) {
    if (int(dims.size()) < core_rank) return false;
    lead.assign(dims.begin(), dims.end() - core_rank);
    core.assign(dims.end() - core_rank, dims.end());
    return true;
  }
};

// The attributes of every call, decoded once into this struct (the XLA FFI's attribute dictionary,
// handlers.h; the DLPack entry points' keyword arguments, module.cc), all int64, listed once here:
// RLK_ATTRS(X) applies X to each name.
#define RLK_ATTRS(X) X(vocab_start), X(real_vocab), X(chunk), X(ignore_index), X(has_bias), X(with_entropy)
#define RLK_ATTR_NAME(name) name
struct Attrs {
  int64_t RLK_ATTRS(RLK_ATTR_NAME);
};

// A stage's buffer table. kOpt: optional in the XLA FFI too, where an empty buffer means absent (the
// nucleus's buffers; DLPack passes None).
enum Flag : unsigned { kIn = 1, kOut = 2, kFfi = 4, kDl = 8, kBoth = kFfi | kDl, kOpt = 16 };
template <class IO>
struct Field {
  const char* name;
  Buf IO::* member;
  unsigned flags;
  int core_rank;
};

// The operands forward and backward share: the problem's.
struct Operands {
  Buf hidden, weight, bias, targets, temperature;
};

// What a combine writes: the rows' logp, entropy, m and log_s [n] f32; with a nucleus log_s_keep.
struct CombineOut {
  Buf logp, entropy, m, log_s, log_s_keep;
};

// forward: per-(row, chunk) statistics and the target logit; with saved_logits (non-empty) also
// what the fast backward reads (saved_logits_bytes of the executor, in its own layout); with a
// nucleus (keep, keep_sum; both entry points) its per-chunk sums. DLPack only: the combine of a call
// over the whole vocab in the same call.
struct ForwardIO : Operands, CombineOut {
  Buf keep;
  Buf stats, target_logit, saved_logits, workspace, keep_sum;
};

// combine: all chunks' statistics -> logp, entropy, m, log_s; with the nucleus's sums, log_s_keep.
struct CombineIO : CombineOut {
  Buf stats, target_logit, targets, keep_sum;
  Buf workspace;  // unused (every XLA target has one)
};

// backward: dhidden, dweight, dbias, dtemp; with saved_logits (non-empty) the fast strategy, else
// lean. The XLA FFI passes saved_logits as an operand aliased to a result (the CUDA backend
// overwrites it): the result is the one written. With a nucleus: keep, log_s_keep.
struct BackwardIO : Operands {
  Buf m, log_s, entropy, g, e, keep, log_s_keep;
  Buf saved_logits, dhidden, dweight, dbias, dtemp, workspace;
};

template <class T, size_t A, size_t B>
constexpr std::array<T, A + B> cat(const std::array<T, A>& a, const std::array<T, B>& b) {
  std::array<T, A + B> out{};
  for (size_t i = 0; i < A; ++i) out[i] = a[i];
  for (size_t i = 0; i < B; ++i) out[A + i] = b[i];
  return out;
}

// The Operands' fields, first in forward's and backward's tables.
template <class IO>
constexpr std::array<Field<IO>, 5> operand_fields() {
  return {{{"hidden", &IO::hidden, kIn | kBoth, 2},
           {"weight", &IO::weight, kIn | kBoth, 2},
           {"bias", &IO::bias, kIn | kBoth, 1},
           {"targets", &IO::targets, kIn | kBoth, 1},
           {"temperature", &IO::temperature, kIn | kBoth, 1}}};
}

// The CombineOut's fields, passed by `where` (log_s_keep optional).
template <class IO>
constexpr std::array<Field<IO>, 5> combine_out_fields(unsigned where) {
  return {{{"logp", &IO::logp, kOut | where, 1},
           {"entropy", &IO::entropy, kOut | where, 1},
           {"m", &IO::m, kOut | where, 1},
           {"log_s", &IO::log_s, kOut | where, 1},
           {"log_s_keep", &IO::log_s_keep, kOut | where | kOpt, 1}}};
}

template <class IO>
constexpr auto fields();

template <>
constexpr auto fields<ForwardIO>() {
  using IO = ForwardIO;
  constexpr std::array<Field<IO>, 6> own{{{"keep", &IO::keep, kIn | kBoth | kOpt, 2},
                                          {"stats", &IO::stats, kOut | kBoth, 3},
                                          {"target_logit", &IO::target_logit, kOut | kBoth, 1},
                                          {"saved_logits", &IO::saved_logits, kOut | kBoth, 1},
                                          {"keep_sum", &IO::keep_sum, kOut | kBoth | kOpt, 2},
                                          {"workspace", &IO::workspace, kOut | kBoth, 1}}};
  return cat(cat(operand_fields<IO>(), own), combine_out_fields<IO>(kDl));
}

template <>
constexpr auto fields<CombineIO>() {
  using IO = CombineIO;
  constexpr std::array<Field<IO>, 4> in{{{"stats", &IO::stats, kIn | kBoth, 3},
                                         {"target_logit", &IO::target_logit, kIn | kBoth, 1},
                                         {"targets", &IO::targets, kIn | kBoth, 1},
                                         {"keep_sum", &IO::keep_sum, kIn | kBoth | kOpt, 2}}};
  constexpr std::array<Field<IO>, 1> ws{{{"workspace", &IO::workspace, kOut | kFfi, 1}}};
  return cat(cat(in, combine_out_fields<IO>(kBoth)), ws);
}

template <>
constexpr auto fields<BackwardIO>() {
  using IO = BackwardIO;
  constexpr std::array<Field<IO>, 14> own{{{"m", &IO::m, kIn | kBoth, 1},
                                           {"log_s", &IO::log_s, kIn | kBoth, 1},
                                           {"entropy", &IO::entropy, kIn | kBoth, 1},
                                           {"g", &IO::g, kIn | kBoth, 1},
                                           {"e", &IO::e, kIn | kBoth, 1},
                                           {"keep", &IO::keep, kIn | kBoth | kOpt, 2},
                                           {"log_s_keep", &IO::log_s_keep, kIn | kBoth | kOpt, 1},
                                           {"saved_logits", &IO::saved_logits, kIn | kBoth, 1},
                                           {"dhidden", &IO::dhidden, kOut | kBoth, 2},
                                           {"dweight", &IO::dweight, kOut | kBoth, 2},
                                           {"dbias", &IO::dbias, kOut | kBoth, 1},
                                           {"dtemp", &IO::dtemp, kOut | kBoth, 1},
                                           {"saved_logits", &IO::saved_logits, kOut | kFfi, 1},
                                           {"workspace", &IO::workspace, kOut | kBoth, 1}}};
  return cat(operand_fields<IO>(), own);
}

// The batch of a call: the leading dimensions of this stage's first result.
template <class IO>
const Buf& batch_source(const IO& io) {
  if constexpr (std::is_same_v<IO, ForwardIO>) return io.stats;
  else if constexpr (std::is_same_v<IO, CombineIO>) return io.logp;
  else return io.dhidden;
}

// A failed call: invalid arguments (checked before anything is read or written) or a kernel's error.
struct Fail {
  enum Kind { kNone, kInvalid, kKernel } kind = kNone;
  std::string what;
  explicit operator bool() const { return kind != kNone; }
};
inline Fail invalid(const std::string& what) { return {Fail::kInvalid, "rlk: " + what}; }
inline Fail kernel(Status s) { return s ? Fail{Fail::kKernel, s} : Fail{}; }

// Split every given buffer of io at its field's core rank.
template <class IO>
Fail split_all(IO& io) {
  for (const auto& f : fields<IO>()) {
    Buf& b = io.*f.member;
    if (b.given && !b.split(f.core_rank))
      return invalid(std::string(f.name) + " has rank " + std::to_string(b.dims.size()) + ", below its " +
                     std::to_string(f.core_rank) + " core dimensions");
  }
  return {};
}

// ---- The buffer rule: dtype and [batch..., core...] ---------------------------------------------
constexpr int64_t kAny = -1;  // a core dimension not checked here

inline std::string shape_str(const std::vector<int64_t>& lead, const std::vector<int64_t>& core) {
  std::string s = "(";
  for (int64_t d : lead) s += std::to_string(d) + ", ";
  for (int64_t d : core) s += std::to_string(d) + ", ";
  if (s.size() > 1) s.resize(s.size() - 2);
  return s + ")";
}

struct Rules {
  std::vector<int64_t> batch;
  int device;
  Fail fail;

  // name must be given, of dtype `want` and [batch..., core...]; a result's leading dimensions are
  // the batch's exactly, an input's may be 1.
  bool need(const char* name, const Buf& b, Elem want, std::initializer_list<int64_t> core, bool result = false) {
    if (fail) return false;
    const std::vector<int64_t> c(core);
    bool ok = b.given && b.elem == want && b.dims.size() == batch.size() + c.size() && b.device == device;
    for (size_t i = 0; ok && i < b.dims.size(); ++i) {
      const int64_t w = i < batch.size() ? batch[i] : c[i - batch.size()];
      ok = w == kAny || b.dims[i] == w || (i < batch.size() && !result && b.dims[i] == 1);
    }
    if (!ok) {
      std::string got = b.given ? shape_str({}, b.dims) + " " + elem_name(b.elem) : "nothing";
      if (b.given && b.device != device) got += " on another device";
      fail = invalid(std::string(name) + " must be " + shape_str(batch, c) + " " + elem_name(want) +
                     " (-1: any size), got " + got);
    }
    return ok;
  }
  // name is optional: absent, or as need().
  void maybe(const char* name, const Buf& b, Elem want, std::initializer_list<int64_t> core, bool result = false) {
    if (b.given) need(name, b, want, core, result);
  }
  void require(bool ok, const char* what) {
    if (!fail && !ok) fail = invalid(what);
  }
};

// ---- check -> Problem, one function a stage -------------------------------------------------------
// The chunk rule (a Problem's v % chunk == 0), for the calls and the shape-only queries alike.
inline bool chunk_fits(int64_t v, int64_t chunk) { return chunk > 0 && v % chunk == 0; }
constexpr const char* kChunkRule = "chunk must be > 0 and divide the local vocab";

// The rules of the operands forward and backward share; fills p.
inline void check_problem(Rules& r, const Operands& io, const Attrs& at, Problem* p) {
  const Buf &hidden = io.hidden, &weight = io.weight;
  if (!hidden.given || hidden.core.size() != 2 || !weight.given || weight.core.size() != 2)
    return r.require(false, "hidden must be [..., n, h] and weight [..., v, h]");
  if (!to_dtype(hidden.elem, &p->dtype)) return r.require(false, "hidden must be float32, float16 or bfloat16");
  p->n = hidden.core[0];
  p->h = hidden.core[1];
  p->v = weight.core[0];
  p->vocab_start = at.vocab_start;
  p->real_vocab = at.real_vocab;
  p->chunk = at.chunk;
  p->ignore_index = at.ignore_index;
  p->has_bias = at.has_bias != 0;
  p->with_entropy = at.with_entropy != 0;
  r.require(chunk_fits(p->v, p->chunk), kChunkRule);
  const Elem dt = hidden.elem;
  r.need("hidden", hidden, dt, {p->n, p->h});
  r.need("weight", weight, dt, {p->v, p->h});
  if (p->has_bias) r.need("bias", io.bias, Elem::kF32, {p->v});
  r.need("targets", io.targets, Elem::kS32, {p->n});
  r.need("temperature", io.temperature, Elem::kF32, {p->n});
}

// The saved logits: absent or empty (nothing saved), else uint8 of at least saved_logits_bytes a batch item.
inline bool saved(const Buf& b) { return b.given && b.core_elems() > 0; }
inline void check_saved(Rules& r, const Buf& b, size_t saved_logits_bytes) {
  if (!saved(b)) return;
  r.need("saved_logits", b, Elem::kU8, {kAny}, true);
  r.require(b.core_bytes() >= int64_t(saved_logits_bytes),
            "saved_logits (the fast backward's record) must hold saved_logits_bytes(problem) bytes per batch item");
}

inline void check_combine_out(Rules& r, const CombineOut& io, int64_t n) {
  for (const auto& [name, b] : {std::pair<const char*, const Buf*>{"logp", &io.logp},
                                {"entropy", &io.entropy},
                                {"m", &io.m},
                                {"log_s", &io.log_s}})
    r.need(name, *b, Elem::kF32, {n}, true);
  r.maybe("log_s_keep", io.log_s_keep, Elem::kF32, {n}, true);
}

inline void check(Rules& r, const ForwardIO& io, const Attrs& at, size_t (*saved_logits_bytes)(const Problem&),
                  Problem* p) {
  check_problem(r, io, at, p);
  if (r.fail) return;
  const int64_t n = p->n, k = num_chunks(*p);
  r.need("stats", io.stats, Elem::kF32, {n, k, kStatWidth}, true);
  r.need("target_logit", io.target_logit, Elem::kF32, {n}, true);
  check_saved(r, io.saved_logits, saved_logits_bytes(*p));
  r.maybe("workspace", io.workspace, Elem::kU8, {kAny}, true);
  r.require(io.keep.given == io.keep_sum.given, "keep and keep_sum come together");
  r.maybe("keep (the nucleus: uint8 [n, v_local])", io.keep, Elem::kU8, {n, p->v});
  r.maybe("keep_sum", io.keep_sum, Elem::kF32, {n, k}, true);
  const bool combine = io.logp.given;
  r.require(combine == io.entropy.given && combine == io.m.given && combine == io.log_s.given,
            "logp, entropy, m and log_s come together");
  if (!combine) return r.require(!io.log_s_keep.given, "log_s_keep comes with keep in a combining forward");
  r.require(at.vocab_start == 0 && p->v >= at.real_vocab, "the forward combines only a call over the whole vocab");
  r.require(io.log_s_keep.given == io.keep.given, "log_s_keep comes with keep in a combining forward");
  check_combine_out(r, io, n);
}

inline void check_combine(Rules& r, const CombineIO& io) {
  r.require(io.stats.given && io.stats.core.size() == 3, "stats must be [..., n, chunks, 3]");
  if (r.fail) return;
  const int64_t n = io.stats.core[0], k = io.stats.core[1];
  r.need("stats", io.stats, Elem::kF32, {n, k, kStatWidth});
  r.need("target_logit", io.target_logit, Elem::kF32, {n});
  r.need("targets", io.targets, Elem::kS32, {n});
  r.require(io.keep_sum.given == io.log_s_keep.given, "keep_sum and log_s_keep come together");
  r.maybe("keep_sum", io.keep_sum, Elem::kF32, {n, k});
  check_combine_out(r, io, n);
}

inline void check(Rules& r, const BackwardIO& io, const Attrs& at, size_t (*saved_logits_bytes)(const Problem&),
                  Problem* p) {
  check_problem(r, io, at, p);
  if (r.fail) return;
  const int64_t n = p->n;
  for (const auto& [name, b] : {std::pair<const char*, const Buf*>{"m", &io.m}, {"log_s", &io.log_s}, {"g", &io.g}})
    r.need(name, *b, Elem::kF32, {n});
  if (p->with_entropy) {
    r.need("entropy", io.entropy, Elem::kF32, {n});
    r.need("e", io.e, Elem::kF32, {n});
  }
  check_saved(r, io.saved_logits, saved_logits_bytes(*p));
  // dhidden: f32 (a vocab shard's partial sum) or the operand dtype (the backend checks which).
  r.need("dhidden", io.dhidden, io.dhidden.elem == Elem::kF32 ? Elem::kF32 : io.hidden.elem, {n, p->h}, true);
  r.need("dweight", io.dweight, io.hidden.elem, {p->v, p->h}, true);
  if (p->has_bias) r.need("dbias", io.dbias, Elem::kF32, {p->v}, true);
  else r.maybe("dbias", io.dbias, Elem::kF32, {0}, true);
  r.need("dtemp", io.dtemp, Elem::kF32, {n}, true);
  r.maybe("workspace", io.workspace, Elem::kU8, {kAny}, true);
  r.require(io.keep.given == io.log_s_keep.given, "keep and log_s_keep come together");
  r.maybe("keep (the nucleus: uint8 [n, v_local])", io.keep, Elem::kU8, {n, p->v});
  r.maybe("log_s_keep", io.log_s_keep, Elem::kF32, {n});
}

// ---- The batch: iteration over the leading dimensions (none in a DLPack call) ----------------------
struct Batch {
  std::vector<int64_t> lead;
  int64_t count = 1;

  explicit Batch(const std::vector<int64_t>& out_lead) : lead(out_lead) {
    for (int64_t d : lead) count *= d;
  }
  bool full(const Buf& v) const { return v.lead == lead; }
  bool single(const Buf& v) const {
    for (int64_t d : v.lead)
      if (d != 1) return false;
    return true;
  }
  // Pointer to batch item b of v (null when v is absent).
  template <class T = void>
  T* at(const Buf& v, int64_t b) const {
    if (!v.given) return nullptr;
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

// Batch item b of the Operands into FwdArgs or BwdArgs.
inline void operands_at(OperandArgs& a, const Operands& io, const Batch& batch, int64_t b, bool has_bias) {
  a.hidden = batch.at(io.hidden, b);
  a.weight = batch.at(io.weight, b);
  a.bias = has_bias ? batch.at<const float>(io.bias, b) : nullptr;
  a.targets = batch.at<const int32_t>(io.targets, b);
  a.temperature = batch.at<const float>(io.temperature, b);
}

// Batch item b of the CombineOut into CombineArgs.
inline void combine_out_at(CombineArgs& a, const CombineOut& io, const Batch& batch, int64_t b) {
  a.logp = batch.at<float>(io.logp, b);
  a.entropy = batch.at<float>(io.entropy, b);
  a.m = batch.at<float>(io.m, b);
  a.log_s = batch.at<float>(io.log_s, b);
  a.log_s_keep = batch.at<float>(io.log_s_keep, b);
}

// Checks io (batched: the XLA FFI's leading dimensions allowed), then runs the stage on `ex` once a
// batch item. Nothing is read or written before every check passed.
template <class IO>
Rules rules_of(const IO& io, bool batched) {
  const Buf& src = batch_source(io);
  Rules r{batched && src.given ? src.lead : std::vector<int64_t>{}, src.device, {}};
  if (!batched && src.given && !src.lead.empty())
    r.fail = invalid(std::string("this entry point takes no batch dimensions (") + shape_str(src.lead, src.core) + ")");
  return r;
}

// The forward's batch items, after run's checks.
template <class Exec>
Fail run_batch(Exec& ex, const ForwardIO& io, const Attrs& at, Problem p, const Batch& batch) {
  // Rows are independent: with one shared weight and every row operand batched alike, the batch
  // folds into the rows (the same bits as a loop, since results are batch invariant).
  const bool fold = batch.single(io.weight) && batch.single(io.bias) && batch.full(io.hidden) &&
                    batch.full(io.targets) && batch.full(io.temperature);
  const int64_t items = fold ? 1 : batch.count;
  if (fold) p.n *= batch.count;
  const bool combine = io.logp.given;
  for (int64_t b = 0; b < items; ++b) {
    FwdArgs a;
    operands_at(a, io, batch, b, p.has_bias);
    a.keep = batch.at<const uint8_t>(io.keep, b);
    a.stats = batch.at<float>(io.stats, b);
    a.target_logit = batch.at<float>(io.target_logit, b);
    a.keep_sum = batch.at<float>(io.keep_sum, b);
    a.saved_logits = saved(io.saved_logits) ? batch.at(io.saved_logits, b) : nullptr;
    if (Fail f = kernel(ex.forward(p, a))) return f;
    if (!combine) continue;
    CombineArgs c;
    c.n = p.n;
    c.k = num_chunks(p);
    c.real_vocab = at.real_vocab;
    c.ignore_index = at.ignore_index;
    c.stats = a.stats;
    c.target_logit = a.target_logit;
    c.targets = a.targets;
    c.keep_sum = a.keep_sum;
    combine_out_at(c, io, batch, b);
    if (Fail f = kernel(ex.combine(c))) return f;
  }
  return {};
}

template <class Exec>
Fail run(Exec& ex, const CombineIO& io, const Attrs& at, bool batched) {
  Rules r = rules_of(io, batched);
  if (!r.fail) check_combine(r, io);
  if (r.fail) return r.fail;
  const Batch batch(r.batch);
  const bool fold = batch.full(io.stats) && batch.full(io.target_logit) && batch.full(io.targets);
  CombineArgs a;
  a.n = io.stats.core[0] * (fold ? batch.count : 1);
  a.k = io.stats.core[1];
  a.real_vocab = at.real_vocab;
  a.ignore_index = at.ignore_index;
  for (int64_t b = 0; b < (fold ? 1 : batch.count); ++b) {
    a.stats = batch.at<const float>(io.stats, b);
    a.target_logit = batch.at<const float>(io.target_logit, b);
    a.targets = batch.at<const int32_t>(io.targets, b);
    a.keep_sum = batch.at<const float>(io.keep_sum, b);
    combine_out_at(a, io, batch, b);
    if (Fail f = kernel(ex.combine(a))) return f;
  }
  return {};
}

// The backward's batch items, after run's checks.
template <class Exec>
Fail run_batch(Exec& ex, const BackwardIO& io, const Attrs& at, const Problem& p, const Batch& batch) {
  DType dh_dtype;
  to_dtype(io.dhidden.elem, &dh_dtype);
  for (int64_t b = 0; b < batch.count; ++b) {
    BwdArgs a;
    operands_at(a, io, batch, b, p.has_bias);
    a.m = batch.at<const float>(io.m, b);
    a.log_s = batch.at<const float>(io.log_s, b);
    a.entropy = p.with_entropy ? batch.at<const float>(io.entropy, b) : nullptr;
    a.g = batch.at<const float>(io.g, b);
    a.e = p.with_entropy ? batch.at<const float>(io.e, b) : nullptr;
    a.keep = batch.at<const uint8_t>(io.keep, b);
    a.log_s_keep = batch.at<const float>(io.log_s_keep, b);
    a.saved_logits = saved(io.saved_logits) ? batch.at(io.saved_logits, b) : nullptr;
    a.dhidden = batch.at(io.dhidden, b);
    a.dhidden_dtype = dh_dtype;
    a.dweight = batch.at(io.dweight, b);
    a.dbias = p.has_bias ? batch.at<float>(io.dbias, b) : nullptr;
    a.dtemp = batch.at<float>(io.dtemp, b);
    if (Fail f = kernel(ex.backward(p, a))) return f;
  }
  return {};
}

// A forward or a backward (the combine has its own run above): its checks and Problem; on success the
// executor takes the call's workspace and run_batch runs the batch items.
template <class Exec, class IO>
Fail run(Exec& ex, const IO& io, const Attrs& at, bool batched) {
  Rules r = rules_of(io, batched);
  Problem p;
  if (!r.fail) check(r, io, at, Exec::saved_logits_bytes, &p);
  if (r.fail) return r.fail;
  ex.use_workspace(io.workspace.data, io.workspace.given ? size_t(io.workspace.core_bytes()) : 0);
  return run_batch(ex, io, at, p, Batch(r.batch));
}

}  // namespace rlk::io
