// memoryos-gpu: bindings of the retrieval path: the term splitter, the fused retrieval pass, the
// heat credit of served pages, and lazily backed host memory for the arena.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <climits>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "memoryos/keywords.h"
#include "memoryos/postings.h"
#include "memoryos/retrieval.h"
#include "memoryos/terms.h"
#include "memoryos/word_set.h"
#include "retrieval_bindings.h"
#include "tensor_arg.h"

namespace memoryos {
namespace {

// ---- vectors out as NumPy arrays, without a copy --------------------------------------------
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  auto* owned = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owned, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>({static_cast<py::ssize_t>(owned->size())}, owned->data(), free_when_done);
}

// ---- the term splitter ----------------------------------------------------------------------
py::tuple split_terms(const TermSplitter& splitter, py::str text, int64_t n_docs,
                      py::object timestamps, int32_t max_terms, bool sorted) {
  PyObject* s = text.ptr();
  if (n_docs < 0) throw py::value_error("n_docs must be >= 0");
  if (max_terms < 1) throw py::value_error("max_terms must be >= 1");
  py::array_t<double, py::array::c_style | py::array::forcecast> ts;
  const double* ts_ptr = nullptr;
  if (!timestamps.is_none()) {
    ts = py::array_t<double, py::array::c_style | py::array::forcecast>(timestamps);
    if (ts.ndim() != 1 || ts.shape(0) != n_docs)
      throw py::value_error("timestamps must be one float per document");
    ts_ptr = ts.data();
  }
  const int kind = PyUnicode_KIND(s);
  const void* data = PyUnicode_DATA(s);
  const auto length = static_cast<size_t>(PyUnicode_GET_LENGTH(s));
  TermOptions options;
  options.max_terms = max_terms;
  options.sorted = sorted;
  TermBatch batch;
  {
    py::gil_scoped_release release;  // `text` and `ts` stay referenced by this frame
    batch = splitter.split(data, length, kind, n_docs, ts_ptr, options);
  }
  return py::make_tuple(to_numpy(std::move(batch.offsets)), to_numpy(std::move(batch.ids)),
                        to_numpy(std::move(batch.tf)), to_numpy(std::move(batch.length)));
}

// ---- keyword candidates ---------------------------------------------------------------------
/// The Python str of one candidate word (UTF-8 bytes [p, p + n), its word_hash `h` from the
/// scan), new reference.
///
/// Why a cache: a batch's candidates are mostly words earlier batches had ("weekend",
/// "sister"), and making each a new str (then hashing it again in the Counter and dict that
/// read it, then freeing it) cost ~10 % of a scan (512 LoCoMo pages: 3.95 -> 3.57 us a page
/// with the cache), besides the readers' hashing. Recent ASCII words keep their str
/// here, direct-mapped by word_hash and checked byte for byte, so a hit is the same immutable
/// object (with its hash already computed) and a collision only costs a new one. Bounded: one
/// slot each, short words only; touched with the GIL held.
PyObject* word_str(const char* p, size_t n, uint64_t h) {
  constexpr size_t kSlots = size_t{1} << 14, kMaxBytes = 24;
  struct Slot {
    uint64_t hash = 0;
    PyObject* str = nullptr;
  };
  static std::vector<Slot> cache(kSlots);  // never freed: the module lives until exit
  bool ascii = n <= kMaxBytes;
  for (size_t i = 0; ascii && i < n; ++i) ascii = static_cast<unsigned char>(p[i]) < 0x80;
  if (!ascii) return PyUnicode_DecodeUTF8(p, static_cast<py::ssize_t>(n), "strict");
  Slot& e = cache[h & (kSlots - 1)];
  if (e.str != nullptr && e.hash == h && static_cast<size_t>(PyUnicode_GET_LENGTH(e.str)) == n &&
      std::memcmp(PyUnicode_1BYTE_DATA(e.str), p, n) == 0) {
    Py_INCREF(e.str);
    return e.str;
  }
  PyObject* str = PyUnicode_New(static_cast<py::ssize_t>(n), 127);
  if (str == nullptr) return nullptr;
  std::memcpy(PyUnicode_1BYTE_DATA(str), p, n);
  Py_XDECREF(e.str);
  Py_INCREF(str);  // the cache's reference
  e.hash = h, e.str = str;
  return str;
}

py::tuple scan_keywords(const KeywordScanner& scanner, py::str text, int64_t n_docs,
                        bool with_ids) {
  PyObject* s = text.ptr();
  if (n_docs < 0) throw py::value_error("n_docs must be >= 0");
  const int kind = PyUnicode_KIND(s);
  const void* data = PyUnicode_DATA(s);
  const auto length = static_cast<size_t>(PyUnicode_GET_LENGTH(s));
  KeywordBatch batch;
  {
    py::gil_scoped_release release;  // `text` stays referenced by this frame
    batch = scanner.scan(data, length, kind, n_docs, with_ids);
  }
  py::list words(batch.word_ends.size());
  int64_t start = 0;
  for (size_t i = 0; i < batch.word_ends.size(); ++i) {
    const int64_t end = batch.word_ends[i];
    PyObject* w = word_str(batch.words.data() + start, static_cast<size_t>(end - start),
                           batch.word_hashes[i]);
    if (w == nullptr) throw py::error_already_set();
    PyList_SET_ITEM(words.ptr(), static_cast<py::ssize_t>(i), w);  // steals the reference
    start = end;
  }
  return py::make_tuple(to_numpy(std::move(batch.offsets)), to_numpy(std::move(batch.ids)),
                        to_numpy(std::move(batch.tf)), to_numpy(std::move(batch.flags)), words);
}

int32_t term_id_of(const std::string& word) {
  return term_id(reinterpret_cast<const uint8_t*>(word.data()), word.size());
}

/// Whether a str is a word normalize_word leaves as it is: ASCII lower-case letters and digits
/// only (its UTF-8 bytes are then the str's own).
bool plain_ascii_word(PyObject* w) {
  if (!PyUnicode_IS_ASCII(w)) return false;
  const auto* p = PyUnicode_1BYTE_DATA(w);
  const auto n = PyUnicode_GET_LENGTH(w);
  for (py::ssize_t i = 0; i < n; ++i) {
    if (!((p[i] >= 'a' && p[i] <= 'z') || (p[i] >= '0' && p[i] <= '9'))) return false;
  }
  return n > 0;
}

/// The arena's padded keyword rows of token lists: row i holds the sorted distinct ids of the
/// first `width` tokens of rows[i], -1 after them.
///
/// Why native: every page reaching MTM, and every segment it joins or opens, makes a row (a
/// joined segment's from all its keywords), and the NumPy version (hash each token through
/// the LRU cache, then one lexsort of the batch) cost ~190 ns a token. A plain word (ASCII
/// lower case and digits, what the extractor mostly gives) is hashed here through the term id
/// cache; any other token goes through `fallback` (keywords.hash_keyword, which normalises
/// first), so every id is the one hash_keyword gives.
py::array_t<int32_t> keyword_rows_of(py::handle rows, int32_t width, py::handle fallback) {
  if (width < 1) throw py::value_error("width must be >= 1");
  py::object outer = py::reinterpret_steal<py::object>(
      PySequence_Fast(rows.ptr(), "token lists must be a sequence"));
  if (!outer) throw py::error_already_set();
  const py::ssize_t n = PySequence_Fast_GET_SIZE(outer.ptr());
  py::array_t<int32_t> out({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(width)});
  int32_t* o = out.mutable_data();
  std::fill(o, o + n * width, -1);
  std::vector<int32_t> ids;
  for (py::ssize_t i = 0; i < n; ++i) {
    PyObject* tokens = PySequence_Fast_GET_ITEM(outer.ptr(), i);
    py::object row = py::reinterpret_steal<py::object>(
        PySequence_Fast(tokens, "a token list must be a sequence"));
    if (!row) throw py::error_already_set();
    const py::ssize_t m = std::min<py::ssize_t>(PySequence_Fast_GET_SIZE(row.ptr()), width);
    ids.clear();
    for (py::ssize_t j = 0; j < m; ++j) {
      PyObject* w = PySequence_Fast_GET_ITEM(row.ptr(), j);
      int64_t id;
      if (PyUnicode_Check(w) && plain_ascii_word(w)) {
        const std::string_view word(reinterpret_cast<const char*>(PyUnicode_1BYTE_DATA(w)),
                                    static_cast<size_t>(PyUnicode_GET_LENGTH(w)));
        id = cached_term_id(word, word_hash(word));
      } else {
        id = fallback(py::handle(w)).cast<int64_t>();
      }
      if (id >= 0) ids.push_back(static_cast<int32_t>(id));
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    std::copy(ids.begin(), ids.end(), o + i * width);
  }
  return out;
}

// ---- lazily backed zeroed memory ------------------------------------------------------------
/// Anonymous memory the kernel backs page by page as it is first written, reserved without
/// counting against the overcommit limit (MAP_NORESERVE). Without transparent huge pages by
/// default (a sparse array stays resident only where written); `huge` asks for them, for an
/// array written densely from the front whose rows are read at random (the page pool's
/// embeddings: 2 GB at 100,000 users, where each candidate row in its own 4 KB page is a TLB
/// miss besides the cache miss).
class LazyBuffer {
 public:
  LazyBuffer(size_t nbytes, bool huge) : size_(nbytes), huge_(huge) {
    if (nbytes == 0) return;
    void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("cannot reserve " + std::to_string(nbytes) +
                               " bytes of address space: " + std::strerror(errno));
    }
#if defined(MADV_NOHUGEPAGE) && defined(MADV_HUGEPAGE)
    madvise(p, nbytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
    data_ = p;
  }
  ~LazyBuffer() {
    if (data_ != nullptr) munmap(data_, size_);
  }
  LazyBuffer(const LazyBuffer&) = delete;
  LazyBuffer& operator=(const LazyBuffer&) = delete;

  bool huge() const { return huge_; }

  /// Give the whole pages inside [offset, offset + length) back to the OS; they read as zeros
  /// again (MADV_DONTNEED on private anonymous memory). For a copy that moves rows elsewhere:
  /// each part of the old buffer is released once copied, so the old and the new rows are
  /// never all resident at once. Returns the bytes released.
  size_t release(size_t offset, size_t length) {
    if (data_ == nullptr || offset >= size_) return 0;
    length = std::min(length, size_ - offset);
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t lo = (offset + page - 1) / page * page;
    const size_t hi = (offset + length) / page * page;
    if (hi <= lo) return 0;
    if (madvise(static_cast<char*>(data_) + lo, hi - lo, MADV_DONTNEED) != 0) {
      throw std::runtime_error(std::string("madvise(MADV_DONTNEED): ") + std::strerror(errno));
    }
    return hi - lo;
  }

  py::buffer_info info() {
    return py::buffer_info(data_ != nullptr ? data_ : &empty_, 1, "B", 1,
                           {static_cast<py::ssize_t>(size_)}, {1});
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  bool huge_ = false;
  uint8_t empty_ = 0;
};

// ---- the fused retrieval pass ---------------------------------------------------------------
EmbDtype emb_dtype_of(const TensorArg& t, bool cuda) {
  if (!cuda) {
    expect_dtype(t, {Dt::f32});
    return EmbDtype::kFloat32;
  }
  expect_dtype(t, {Dt::f32, Dt::f16, Dt::bf16});
  return t.dtype == Dt::f16 ? EmbDtype::kFloat16
                            : (t.dtype == Dt::bf16 ? EmbDtype::kBFloat16 : EmbDtype::kFloat32);
}

void check_cuda_build(bool cuda) {
  if (cuda && !cuda_compiled()) {
    throw py::value_error("arrays are on a CUDA device but this build of memoryos_gpu has no "
                          "CUDA kernels; rebuild with CUDA");
  }
}

void retrieve(py::object q_emb, py::object q_user, py::object term_offsets, py::object term_ids,
              py::object seg_emb, py::object seg_kw, py::object seg_live, py::object page_emb,
              py::object page_live, py::object seg_npages, py::object block_table,
              int32_t block_size, py::object lex_start, py::object lex_count,
              py::object lex_length, py::object lex_terms, py::object lex_tf,
              int32_t top_segments, float keyword_weight, int32_t jaccard_terms,
              float dense_floor, float lexical_weight, int32_t lexical_candidates,
              float bm25_k1, float bm25_b, py::object out_score, py::object out_page,
              py::object out_segment, py::object scratch, int64_t stream, py::object postings) {
  auto qe = tensor_arg(q_emb, "q_emb", stream), qu = tensor_arg(q_user, "q_user", stream),
       to = tensor_arg(term_offsets, "term_offsets", stream),
       ti = tensor_arg(term_ids, "term_ids", stream), se = tensor_arg(seg_emb, "seg_emb", stream),
       sk = tensor_arg(seg_kw, "seg_kw", stream), sl = tensor_arg(seg_live, "seg_live", stream),
       pe = tensor_arg(page_emb, "page_emb", stream),
       pl = tensor_arg(page_live, "page_live", stream),
       np_ = tensor_arg(seg_npages, "seg_npages", stream),
       bt = tensor_arg(block_table, "block_table", stream),
       ls = tensor_arg(lex_start, "lex_start", stream),
       lc = tensor_arg(lex_count, "lex_count", stream),
       ll = tensor_arg(lex_length, "lex_length", stream),
       lt = tensor_arg(lex_terms, "lex_terms", stream), lf = tensor_arg(lex_tf, "lex_tf", stream),
       os = tensor_arg(out_score, "out_score", stream),
       op = tensor_arg(out_page, "out_page", stream),
       og = tensor_arg(out_segment, "out_segment", stream);
  const bool cuda =
      same_device({&qe, &qu, &to, &ti, &se, &sk, &sl, &pe, &pl, &np_, &bt, &ls, &lc, &ll, &lt, &lf, &os, &op, &og});
  expect_ndim(qe, 2);
  expect(qe, {-1, -1}, Dt::f32);
  const int64_t B = qe.dim(0);
  const int64_t d = qe.dim(1);
  expect(qu, {B}, Dt::i32);
  expect(to, {B + 1}, Dt::i64);
  expect_ndim(ti, 1);
  expect_dtype(ti, {Dt::i32});
  expect_ndim(se, 3);
  if (se.dim(2) != d) throw py::value_error("seg_emb dim != query dim");
  expect(sk, {se.dim(0), se.dim(1), -1}, Dt::i32);
  expect(sl, {se.dim(0), se.dim(1)}, Dt::u8);
  expect_ndim(pe, 2);
  if (pe.dim(1) != d) throw py::value_error("page_emb dim != query dim");
  const int64_t NP = pe.dim(0);
  expect(pl, {NP}, Dt::u8);
  expect(np_, {se.dim(0), se.dim(1)}, Dt::i32);
  expect(bt, {se.dim(0), se.dim(1), -1}, Dt::i32);
  expect(ls, {NP}, Dt::i64);
  expect(lc, {NP}, Dt::i32);
  expect(ll, {NP}, Dt::i32);
  expect_ndim(lt, 1);
  expect(lt, {-1}, Dt::i32);
  expect(lf, {lt.dim(0)}, Dt::i32);
  expect_ndim(os, 2);
  expect(os, {B, -1}, Dt::f32);
  expect(op, {B, os.dim(1)}, Dt::i32);
  expect(og, {B, os.dim(1)}, Dt::i32);
  if (os.dim(1) < 1) throw py::value_error("top_pages must be >= 1");
  if (top_segments < 1) throw py::value_error("top_segments must be >= 1");
  if (jaccard_terms < 0) throw py::value_error("jaccard_terms must be >= 0");
  if (lexical_candidates < 0) throw py::value_error("lexical_candidates must be >= 0");
  if (block_size < 1) throw py::value_error("block_size must be >= 1");
  if (!std::isfinite(keyword_weight) || !std::isfinite(lexical_weight) || lexical_weight < 0.f ||
      std::isnan(dense_floor) || !(bm25_k1 >= 0.f) || !(bm25_b >= 0.f && bm25_b <= 1.f)) {
    throw py::value_error("retrieval weights must be finite (lexical_weight >= 0, 0 <= b <= 1) "
                          "and the floor not NaN");
  }
  check_cuda_build(cuda);
  if (!cuda) {  // the CUDA kernel bounds-checks on the device; here the rows are read directly
    const int32_t* users = qu.ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      if (users[b] < 0 || users[b] >= se.dim(0))
        throw py::index_error("q_user[" + std::to_string(b) + "] is not a valid user slot");
    const int64_t* off = to.ptr<int64_t>();
    if (off[0] != 0 || off[B] != ti.dim(0))
      throw py::value_error("term_offsets must start at 0 and end at len(term_ids)");
    for (int64_t b = 0; b < B; ++b)
      if (off[b + 1] < off[b]) throw py::value_error("term_offsets must not decrease");
  }
  QueryBatch q{qe.ptr<float>(), qu.ptr<int32_t>(), nullptr, B, static_cast<int32_t>(d), 0};
  QueryTerms terms{to.ptr<int64_t>(), ti.ptr<int32_t>()};
  SegmentView seg{se.data, sk.ptr<int32_t>(), sl.ptr<uint8_t>(), se.dim(0),
                  static_cast<int32_t>(se.dim(1)), static_cast<int32_t>(sk.dim(2)),
                  emb_dtype_of(se, cuda)};
  PageView pages{pe.data, pl.ptr<uint8_t>(), np_.ptr<int32_t>(), bt.ptr<int32_t>(), NP,
                 np_.dim(0), static_cast<int32_t>(np_.dim(1)), block_size,
                 static_cast<int32_t>(bt.dim(2)), emb_dtype_of(pe, cuda)};
  LexicalView lex{ls.ptr<int64_t>(), lc.ptr<int32_t>(), ll.ptr<int32_t>(), lt.ptr<int32_t>(),
                  lf.ptr<int32_t>(), lt.dim(0)};
  RetrievalParams params{top_segments, keyword_weight, jaccard_terms, dense_floor,
                         lexical_weight, lexical_candidates, bm25_k1, bm25_b};
  RetrievalOut out{os.ptr<float>(), op.ptr<int32_t>(), og.ptr<int32_t>(),
                   static_cast<int32_t>(os.dim(1))};
  float* scratch_ptr = nullptr;
  int32_t scratch_width = 0;
  std::optional<TensorArg> sc;
  if (cuda) {  // the CPU keeps its scratch per thread; the GPU gets it from the caller
    sc = tensor_arg(scratch, "scratch", stream);
    expect_ndim(*sc, 2);
    expect(*sc, {B, -1}, Dt::f32);
    if (!sc->on_cuda || sc->device_id != qe.device_id)
      throw py::value_error("scratch must live on the queries' device");
    if (sc->dim(1) % 2 != 0 || sc->dim(1) / 2 > INT32_MAX)
      throw py::value_error("scratch must be [B, 2 * width]");
    scratch_ptr = sc->ptr<float>();
    scratch_width = static_cast<int32_t>(sc->dim(1) / 2);
  }
  const Postings* post = nullptr;
  if (!postings.is_none()) {
    if (cuda) throw py::value_error("postings are a CPU structure: None with device arrays");
    post = postings.cast<const Postings*>();
    if (post->num_slots() != NP) throw py::value_error("postings must follow this page pool");
  }
  if (B == 0) return;
  py::gil_scoped_release release;
  if (cuda) retrieve_cuda(q, terms, seg, pages, lex, params, out, scratch_ptr, scratch_width, stream);
  else retrieve_cpu(q, terms, seg, pages, lex, post, params, out);
}

void credit_served(py::object user, py::object segment, py::object now, py::object n_visit,
                   py::object l_interaction, py::object last_access, py::object heat_,
                   py::object live, float alpha, float beta, float gamma, double mu, float tau,
                   py::object out_credited, py::object out_promote, int64_t stream) {
  auto us = tensor_arg(user, "user", stream), sg = tensor_arg(segment, "segment", stream),
       nw = tensor_arg(now, "now", stream), nv = tensor_arg(n_visit, "n_visit", stream),
       li = tensor_arg(l_interaction, "l_interaction", stream),
       la = tensor_arg(last_access, "last_access", stream), ht = tensor_arg(heat_, "heat", stream),
       lv = tensor_arg(live, "live", stream), oc = tensor_arg(out_credited, "out_credited", stream),
       opr = tensor_arg(out_promote, "out_promote", stream);
  const bool cuda = same_device({&us, &sg, &nw, &nv, &li, &la, &ht, &lv, &oc, &opr});
  expect_ndim(lv, 2);
  expect(lv, {-1, -1}, Dt::u8);
  const std::vector<int64_t> shape{lv.dim(0), lv.dim(1)};
  expect(nv, shape, Dt::i32);
  expect(li, shape, Dt::i32);
  expect(la, shape, Dt::f64);
  expect(ht, shape, Dt::f32);
  expect_ndim(us, 1);
  expect(us, {-1}, Dt::i32);
  const int64_t B = us.dim(0);
  expect_ndim(sg, 2);
  expect(sg, {B, -1}, Dt::i32);
  expect(nw, {B}, Dt::f64);
  expect(oc, {B, sg.dim(1)}, Dt::u8);
  expect(opr, {B, sg.dim(1)}, Dt::u8);
  if (!(mu > 0.0) || !std::isfinite(mu)) throw py::value_error("mu must be a positive number of seconds");
  if (!std::isfinite(alpha) || !std::isfinite(beta) || !std::isfinite(gamma) || std::isnan(tau))
    throw py::value_error("heat weights must be finite");
  check_cuda_build(cuda);
  if (!cuda) {
    const int32_t* u = us.ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      if (u[b] < 0 || u[b] >= lv.dim(0)) throw py::index_error("user slot out of range");
  }
  HeatState state{nv.ptr<int32_t>(), li.ptr<int32_t>(), la.ptr<double>(), ht.ptr<float>(),
                  lv.ptr<uint8_t>(), lv.dim(0), static_cast<int32_t>(lv.dim(1))};
  ServedHits hits{us.ptr<int32_t>(), sg.ptr<int32_t>(), nw.ptr<double>(), B,
                  static_cast<int32_t>(sg.dim(1)), oc.ptr<uint8_t>(), opr.ptr<uint8_t>()};
  HeatParams params{alpha, beta, gamma, mu, tau};
  if (B == 0) return;
  py::gil_scoped_release release;
  if (cuda) credit_served_cuda(hits, state, params, stream);
  else credit_served_cpu(hits, state, params);
}

// ---- postings of long histories --------------------------------------------------------------
template <typename T>
using Arr = py::array_t<T, py::array::c_style | py::array::forcecast>;

/// Slots within the postings' pool, or IndexError.
void check_slots(const Postings& p, const Arr<int64_t>& slots) {
  const int64_t* s = slots.data();
  for (py::ssize_t i = 0; i < slots.size(); ++i) {
    if (s[i] < 0 || s[i] >= p.num_slots()) {
      throw py::index_error("slot " + std::to_string(s[i]) + " is outside the postings' pool");
    }
  }
}

std::vector<int32_t> postings_write(Postings& p, const Arr<int32_t>& users,
                                    const Arr<int64_t>& slots, const Arr<int64_t>& offsets,
                                    const Arr<int32_t>& ids, const Arr<int32_t>& tf) {
  const py::ssize_t n = slots.size();
  if (users.size() != n || offsets.size() != n + 1 || ids.size() != tf.size() ||
      offsets.data()[0] != 0 || offsets.data()[n] != ids.size()) {
    throw py::value_error("write: users [n], slots [n], offsets [n + 1] from 0 to len(ids) = "
                          "len(tf)");
  }
  for (py::ssize_t i = 0; i < n; ++i) {
    if (offsets.data()[i + 1] < offsets.data()[i]) {
      throw py::value_error("offsets must not decrease");
    }
  }
  check_slots(p, slots);
  return p.write(users.data(), slots.data(), n, offsets.data(), ids.data(), tf.data());
}

void postings_build(Postings& p, int32_t user, const Arr<int64_t>& slots,
                    const Arr<int64_t>& start, const Arr<int32_t>& count,
                    const Arr<int32_t>& terms, const Arr<int32_t>& tf) {
  if (start.size() != p.num_slots() || count.size() != p.num_slots() ||
      terms.size() != tf.size()) {
    throw py::value_error("build: start and count [pool slots], terms and tf of one length");
  }
  check_slots(p, slots);
  for (py::ssize_t i = 0; i < slots.size(); ++i) {
    const int64_t s = slots.data()[i];
    if (start.data()[s] < 0 || count.data()[s] < 0 ||
        start.data()[s] + count.data()[s] > terms.size()) {
      throw py::value_error("build: a row lies outside the term pool");
    }
  }
  p.build(user, slots.data(), slots.size(), start.data(), count.data(), terms.data(), tf.data());
}

void register_postings(py::module_& m) {
  py::class_<Postings>(m, "Postings",
                       "Per-user BM25 postings of users with many pages (memoryos/postings.h).")
      .def(py::init<int32_t>(), py::arg("min_pages"))
      .def_property_readonly("min_pages", &Postings::min_pages)
      .def_property_readonly("num_slots", &Postings::num_slots)
      .def("grow_slots", &Postings::grow_slots, py::arg("num_slots"))
      .def("write", &postings_write, py::arg("users"), py::arg("slots"), py::arg("offsets"),
           py::arg("ids"), py::arg("tf"),
           "Rows written; returns the users that reached min_pages without postings.")
      .def(
          "clear",
          [](Postings& p, const Arr<int64_t>& slots, const Arr<int32_t>& terms) {
            if (terms.size() != slots.size()) throw py::value_error("clear: terms [n] per slot");
            check_slots(p, slots);
            p.clear(slots.data(), terms.data(), slots.size());
          },
          py::arg("slots"), py::arg("terms"),
          "Rows cleared (terms: each row's distinct terms): their postings go stale.")
      .def("build", &postings_build, py::arg("user"), py::arg("slots"), py::arg("start"),
           py::arg("count"), py::arg("terms"), py::arg("tf"),
           "A user's postings from the rows of its page slots.")
      .def(
          "has", [](const Postings& p, int64_t user) { return p.user(user) != nullptr; },
          py::arg("user"), "Whether the user's queries are scored from postings.")
      .def("nbytes", &Postings::nbytes);
}

}  // namespace

void register_retrieval(py::module_& m) {
  py::class_<TermSplitter>(m, "TermSplitter",
                           "Splits U+0000-joined, NFKC-normalised, case-folded texts into "
                           "hashed terms (memoryos/terms.h has the rules).")
      .def(py::init<const std::vector<std::string>&, const std::vector<std::vector<std::string>>&,
                    const std::vector<std::vector<std::string>>&>(),
           py::arg("stopwords"),
           py::arg("language_stopwords") = std::vector<std::vector<std::string>>{},
           py::arg("language_dates") = std::vector<std::vector<std::string>>{})
      .def("split", &split_terms, py::arg("text"), py::arg("n_docs"),
           py::arg("timestamps") = py::none(), py::arg("max_terms") = 1 << 30,
           py::arg("sorted") = true,
           "-> (offsets int64 [n+1], ids int32, tf int32, length int32 [n]).");
  py::class_<KeywordScanner>(m, "KeywordScanner",
                             "Keyword candidates of U+0000-joined NFKC texts with their surface "
                             "flags (memoryos/keywords.h has the rules).")
      .def(py::init([](const std::vector<std::string>& stopwords,
                       const std::vector<std::string>& date_words,
                       const std::vector<std::string>& ambiguous_dates, int32_t min_len,
                       bool fold_plurals,
                       const std::vector<std::vector<std::string>>& language_stopwords) {
             return KeywordScanner(stopwords, date_words, ambiguous_dates,
                                   KeywordOptions{min_len, fold_plurals}, language_stopwords);
           }),
           py::arg("stopwords"), py::arg("date_words"), py::arg("ambiguous_dates"),
           py::arg("min_len") = 2, py::arg("fold_plurals") = false,
           py::arg("language_stopwords") = std::vector<std::vector<std::string>>{})
      .def("scan", &scan_keywords, py::arg("text"), py::arg("n_docs"),
           py::arg("with_ids") = true,
           "-> (offsets int64 [n+1], ids int32 (-1: not ASCII, or not asked for), tf int32, "
           "flags uint8, words).");
  m.def("term_id", &term_id_of, py::arg("word"),
        "31-bit BLAKE2b id of one normalised word (equals keywords.hash_keyword).");
  m.def("keyword_rows", &keyword_rows_of, py::arg("rows"), py::arg("width"),
        py::arg("fallback"),
        "-> int32 [len(rows), width]: each row's sorted distinct ids of its first `width` "
        "tokens, -1 after them; a token that is not plain ASCII lower case and digits gets "
        "fallback(token) (ids < 0 are left out).");
  m.def("date_words", &date_words, py::arg("timestamp"),
        "The UTC date words of an epoch timestamp, lower case.");
  py::class_<LazyBuffer>(m, "LazyBuffer", py::buffer_protocol(),
                         "Zeroed memory backed page by page on first write (MAP_NORESERVE).")
      .def(py::init<size_t, bool>(), py::arg("nbytes"), py::arg("huge") = false)
      .def_property_readonly("huge", &LazyBuffer::huge,
                             "Whether transparent huge pages were asked for.")
      .def("release", &LazyBuffer::release, py::arg("offset"), py::arg("length"),
           "Return the whole pages inside [offset, offset + length) to the OS (they read as "
           "zeros again); the bytes released.")
      .def_buffer(&LazyBuffer::info);
  m.def("retrieve", &retrieve, py::arg("q_emb"), py::arg("q_user"), py::arg("term_offsets"),
        py::arg("term_ids"), py::arg("seg_emb"), py::arg("seg_kw"), py::arg("seg_live"),
        py::arg("page_emb"), py::arg("page_live"), py::arg("seg_npages"),
        py::arg("block_table"), py::arg("block_size"), py::arg("lex_start"),
        py::arg("lex_count"), py::arg("lex_length"), py::arg("lex_terms"), py::arg("lex_tf"),
        py::arg("top_segments"), py::arg("keyword_weight"), py::arg("jaccard_terms"),
        py::arg("dense_floor"), py::arg("lexical_weight"), py::arg("lexical_candidates"),
        py::arg("bm25_k1"), py::arg("bm25_b"), py::arg("out_score"), py::arg("out_page"),
        py::arg("out_segment"),
        py::arg("scratch") = py::none(), py::arg("stream") = 0, py::arg("postings") = py::none(),
        "The fused retrieval pass: segments, dense and BM25 candidates, fusion, top-k pages.");
  register_postings(m);
  m.def("credit_served", &credit_served, py::arg("user"), py::arg("segment"), py::arg("now"),
        py::arg("n_visit"), py::arg("l_interaction"), py::arg("last_access"), py::arg("heat"),
        py::arg("live"), py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("mu"),
        py::arg("tau"), py::arg("out_credited"), py::arg("out_promote"), py::arg("stream") = 0,
        "Fold served pages into their segments' heat; flag the segments due for promotion.");
}

}  // namespace memoryos
