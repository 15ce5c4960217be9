// memoryos-gpu: a retrieval batch's result objects, built in one native call.
//
// Why native: the kernels leave [B, k] arrays; what a caller gets is one Retrieval per query
// with ~20 RetrievedPage / KnowledgeEntry objects in it. Built in Python that was ~0.5-0.9 us
// an object (an allocation and eight attribute stores through the interpreter): most of a
// query's host time once the kernels and BM25 are native. Here the same objects are made by
// the type's own allocator and their slots filled directly, with the texts copied out of the
// in-memory tables (text_table.h) into fresh str objects, and the loop over the batch is C++.
//
// The classes are the package's slots dataclasses (memoryos_gpu.types); SlotLayout reads the
// offsets of their member descriptors once and refuses a class whose fields are not plain
// object slots, so a change to those classes fails loudly at import, not with corrupt objects.
#include "assembly_bindings.h"

#include "json_writer.h"
#include "text_table.h"

#include <Python.h>
#include <structmember.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace memoryos {
namespace {

namespace py = pybind11;

/// Where each named field of a slots class lives in its objects.
class SlotLayout {
 public:
  SlotLayout(py::type cls, const std::vector<std::string>& fields) : cls_(cls) {
    auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    for (const std::string& name : fields) {
      py::object d = py::getattr(cls, name.c_str(), py::none());
      if (!PyObject_TypeCheck(d.ptr(), &PyMemberDescr_Type)) {
        throw py::type_error(std::string(type->tp_name) + "." + name + " is not a slot");
      }
      const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d.ptr())->d_member;
      if (m->type != T_OBJECT_EX || (m->flags & READONLY)) {
        throw py::type_error(std::string(type->tp_name) + "." + name + " is not an object slot");
      }
      offsets_.push_back(m->offset);
    }
    if (type->tp_dictoffset != 0) throw py::type_error("the class must not have a __dict__");
  }

  size_t size() const { return offsets_.size(); }

  /// A new object with fields[i] = values[i] (new references stolen; NULL on failure, with
  /// every value released).
  PyObject* make(PyObject* const* values) const {
    auto* type = reinterpret_cast<PyTypeObject*>(cls_.ptr());
    PyObject* o = type->tp_alloc(type, 0);
    if (o == nullptr) {
      for (size_t i = 0; i < offsets_.size(); ++i) Py_XDECREF(values[i]);
      return nullptr;
    }
    for (size_t i = 0; i < offsets_.size(); ++i) {
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(o) + offsets_[i]) = values[i];
    }
    return o;
  }

 private:
  py::type cls_;
  std::vector<Py_ssize_t> offsets_;
};

/// A [B, k] array checked to be C-contiguous of element type T (int64 ids, float32 scores).
template <typename T>
py::buffer_info checked(const py::array& a, int64_t rows, const char* what) {
  if (a.ndim() != 2 || a.shape(0) != rows || !a.dtype().is(py::dtype::of<T>()) ||
      !(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(what) + " must be a C-contiguous [B, k] array of " +
                          (std::is_same_v<T, int64_t> ? "int64" : "float32"));
  }
  return a.request();
}

/// One returned page or knowledge entry: its id as a Python int (a new reference, handed on
/// to the object built for it) and as a key, the block and metadata its record holds and the
/// block of its page's chain, if any (pass 2), and its score (unused for STM pages, which have
/// none).
struct Ref {
  PyObject* id;
  int64_t key;
  const TextTable::Block* block;
  PyObject* extra;
  float score;
  const TextTable::Block* chain;
};

/// The refs of a batch: query i's MTM pages, STM pages, user and assistant entries are the
/// four ranges from start[4 i] to start[4 i + 4]. Owns the ids not yet handed on.
struct Refs {
  std::vector<Ref> refs;
  std::vector<size_t> start;
  Refs() = default;
  Refs(const Refs&) = delete;
  Refs& operator=(const Refs&) = delete;
  Refs(Refs&&) = default;  // the moved-from vector is empty: nothing released twice
  ~Refs() {
    for (Ref& r : refs) Py_XDECREF(r.id);
  }
};

/// Ask for the cache lines of a record's block (its header and the start of its texts).
inline void prefetch_block(const TextTable::Block* b) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(b);
  __builtin_prefetch(reinterpret_cast<const char*>(b) + 64);
#endif
}

/// The batch assembler: pages, entries and Retrieval objects for every query.
///
/// Three passes over the batch, because the records are spread over memory: a batch of 64
/// queries of 1,000-10,000 users returns ~1,300 pages and entries that are mostly not in
/// cache, and building them one after another waited for each miss in turn. Pass 1 takes
/// each query's ids (and its profile) and asks for the table slot of every id; pass 2 finds
/// the records and asks for their blocks; pass 3 builds the objects, by then from cache. The
/// tables are not changed in between: the caller holds the engine lock, and no Python code
/// runs after pass 1 but allocation (the engine disables the garbage collector meanwhile).
class Assembler {
 public:
  Assembler(py::type page_cls, py::type entry_cls, py::type retrieval_cls, py::str mtm,
            py::str stm)
      : page_(page_cls, {"page_id", "user_input", "agent_response", "timestamp", "tier", "score",
                         "meta", "extra"}),
        entry_(entry_cls, {"entry_id", "text", "score", "sources"}),
        retrieval_(retrieval_cls, {"user_id", "query", "stm", "pages", "profile",
                                   "user_knowledge", "assistant_knowledge", "retrieval_tokens"}),
        mtm_(mtm),
        stm_(stm),
        stm_attr_("stm"),
        pending_attr_("pending") {}

  py::tuple batch(py::list cleaned, py::list users, const TextTable& views,
                  const TextTable& chains, const TextTable& texts, py::array p_ids,
                  py::array p_scores, py::array uk_ids, py::array uk_scores, py::array ak_ids,
                  py::array ak_scores, py::dict profiles, py::object profile_tokens) const {
    Collected c = collect(cleaned, users, views, chains, texts, p_ids, p_scores, uk_ids,
                          uk_scores, ak_ids, ak_scores, profiles, profile_tokens, true);
    const int64_t b = static_cast<int64_t>(c.profile.size());
    // pass 3: the objects
    py::list out(b);
    int64_t total = 0;
    for (int64_t i = 0; i < b; ++i) {
      PyObject* pair = PyList_GET_ITEM(cleaned.ptr(), i);
      const size_t* at = &c.refs.start[static_cast<size_t>(4 * i)];
      int64_t n = c.tokens[i];
      py::object mtm = build_pages(c.refs, at[0], at[1], mtm_.ptr(), true, &n);
      py::object stm_pages = build_pages(c.refs, at[1], at[2], stm_.ptr(), false, &n);
      py::object u_entries = build_entries(c.refs, at[2], at[3], &n);
      py::object a_entries = build_entries(c.refs, at[3], at[4], &n);
      total += n;
      PyObject* values[8] = {Py_NewRef(PyTuple_GET_ITEM(pair, 0)),
                             Py_NewRef(PyTuple_GET_ITEM(pair, 1)),
                             stm_pages.release().ptr(),
                             mtm.release().ptr(),
                             c.profile[i].release().ptr(),
                             u_entries.release().ptr(),
                             a_entries.release().ptr(),
                             PyLong_FromLongLong(n)};
      if (values[7] == nullptr) {
        for (PyObject* v : values) Py_XDECREF(v);
        throw py::error_already_set();
      }
      PyObject* r = retrieval_.make(values);
      if (r == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), i, r);
    }
    return py::make_tuple(out, total);
  }

  /// The same batch as JSON: per query the bytes of the object a retrieval route answers
  /// (query, stm, pages, profile, user_knowledge, assistant_knowledge, retrieval_tokens; the
  /// server adds user_id and known_user), written straight from the tables, with no Python
  /// object per page or entry. `dumps` serialises what the tables hold as Python objects (a
  /// profile, a page's metadata), once per distinct object in the batch.
  py::tuple bodies(py::list cleaned, py::list users, const TextTable& views,
                   const TextTable& chains, const TextTable& texts, py::array p_ids,
                   py::array p_scores, py::array uk_ids, py::array uk_scores, py::array ak_ids,
                   py::array ak_scores, py::dict profiles, py::object profile_tokens,
                   py::object dumps) const {
    Collected c = collect(cleaned, users, views, chains, texts, p_ids, p_scores, uk_ids,
                          uk_scores, ak_ids, ak_scores, profiles, profile_tokens, false);
    const int64_t b = static_cast<int64_t>(c.profile.size());
    Dumped dumped(dumps);
    py::list out(b);
    int64_t total = 0;
    std::string body;
    for (int64_t i = 0; i < b; ++i) {
      PyObject* query = PyTuple_GET_ITEM(PyList_GET_ITEM(cleaned.ptr(), i), 1);
      if (!PyUnicode_Check(query)) throw py::type_error("queries must be str");
      const size_t* at = &c.refs.start[static_cast<size_t>(4 * i)];
      int64_t n = c.tokens[i];
      body.clear();
      body += "{\"query\":";
      json::put_string(body, PyUnicode_DATA(query),
                       static_cast<size_t>(PyUnicode_GET_LENGTH(query)), PyUnicode_KIND(query));
      body += ",\"stm\":[";
      json_pages(body, c.refs, at[1], at[2], "stm", false, dumped, &n);
      body += "],\"pages\":[";
      json_pages(body, c.refs, at[0], at[1], "mtm", true, dumped, &n);
      body += "],\"profile\":";
      body += dumped(c.profile[i].ptr());
      body += ",\"user_knowledge\":[";
      json_entries(body, c.refs, at[2], at[3], &n);
      body += "],\"assistant_knowledge\":[";
      json_entries(body, c.refs, at[3], at[4], &n);
      body += "],\"retrieval_tokens\":";
      json::put_int(body, n);
      body += '}';
      total += n;
      PyObject* bytes =
          PyBytes_FromStringAndSize(body.data(), static_cast<Py_ssize_t>(body.size()));
      if (bytes == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), i, bytes);
    }
    return py::make_tuple(out, total);
  }

 private:
  /// A [B, k] pair of ids and scores.
  struct Hits {
    py::buffer_info ids, scores;
    const int64_t* id_row(int64_t i) const {
      return static_cast<const int64_t*>(ids.ptr) + i * ids.shape[1];
    }
    const float* score_row(int64_t i) const {
      return static_cast<const float*>(scores.ptr) + i * scores.shape[1];
    }
    int64_t k() const { return ids.shape[1]; }
  };

  /// Passes 1 and 2 of a batch: each query's refs (four ranges of Refs, see Refs) with their
  /// records found, its profile copy and the profile's prompt tokens.
  struct Collected {
    Refs refs;
    std::vector<py::object> profile;
    std::vector<int64_t> tokens;
  };

  Collected collect(py::list cleaned, py::list users, const TextTable& views,
                    const TextTable& chains, const TextTable& texts, py::array p_ids,
                    py::array p_scores, py::array uk_ids, py::array uk_scores, py::array ak_ids,
                    py::array ak_scores, py::dict profiles, py::object profile_tokens,
                    bool ids) const {
    const int64_t b = static_cast<int64_t>(py::len(cleaned));
    if (static_cast<int64_t>(py::len(users)) != b) throw py::value_error("users must have B items");
    Hits pages{checked<int64_t>(p_ids, b, "page ids"), checked<float>(p_scores, b, "page scores")};
    Hits uk{checked<int64_t>(uk_ids, b, "user knowledge ids"),
            checked<float>(uk_scores, b, "user knowledge scores")};
    Hits ak{checked<int64_t>(ak_ids, b, "assistant knowledge ids"),
            checked<float>(ak_scores, b, "assistant knowledge scores")};
    for (const Hits* h : {&pages, &uk, &ak}) {
      if (h->ids.shape[1] != h->scores.shape[1]) {
        throw py::value_error("ids and scores must have the same shape");
      }
    }
    Collected c;
    c.refs.refs.reserve(static_cast<size_t>(b) * 24);
    c.refs.start.reserve(static_cast<size_t>(4 * b + 1));
    c.profile.resize(static_cast<size_t>(b));
    c.tokens.assign(static_cast<size_t>(b), 0);
    // pass 1: ids (tables' slots asked for) and profiles
    for (int64_t i = 0; i < b; ++i) {
      PyObject* pair = PyList_GET_ITEM(cleaned.ptr(), i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        throw py::value_error("cleaned must hold (user_id, query) tuples");
      }
      take_hits(views, pages, i, true, ids, c.refs);
      take_stm(views, PyList_GET_ITEM(users.ptr(), i), c.refs);
      take_hits(texts, uk, i, false, ids, c.refs);
      take_hits(texts, ak, i, false, ids, c.refs);
      c.profile[i] = copy_profile(profiles.ptr(), PyTuple_GET_ITEM(pair, 0));
      if (PyDict_GET_SIZE(c.profile[i].ptr()) > 0) {
        c.tokens[i] = profile_tokens(c.profile[i]).cast<int64_t>();
      }
    }
    c.refs.start.push_back(c.refs.refs.size());
    // pass 2: the records (their blocks asked for)
    for (int64_t i = 0; i < b; ++i) {
      const size_t* at = &c.refs.start[static_cast<size_t>(4 * i)];
      find(views, &chains, c.refs, at[0], at[2]);
      find(texts, nullptr, c.refs, at[2], at[4]);
    }
    return c;
  }

  /// `dumps` of Python objects a body embeds (profiles, page metadata), once per object of a
  /// batch (a user's pages share one metadata object); "{}" / null without calling it.
  class Dumped {
   public:
    explicit Dumped(py::object dumps) : dumps_(std::move(dumps)) {}
    const std::string& operator()(PyObject* obj) {
      auto found = done_.find(obj);
      if (found != done_.end()) return found->second;
      std::string text;
      if (obj == nullptr || obj == Py_None) {
        text = "null";
      } else if (PyDict_Check(obj) && PyDict_GET_SIZE(obj) == 0) {
        text = "{}";
      } else {
        py::object raw = dumps_(py::reinterpret_borrow<py::object>(obj));
        if (!PyBytes_Check(raw.ptr())) throw py::type_error("dumps must return bytes");
        text.assign(PyBytes_AS_STRING(raw.ptr()),
                    static_cast<size_t>(PyBytes_GET_SIZE(raw.ptr())));
      }
      return done_.emplace(obj, std::move(text)).first->second;
    }

   private:
    py::object dumps_;
    std::unordered_map<PyObject*, std::string> done_;
  };

  /// A text of a record as a JSON string (null for a missing one).
  static void json_text(std::string& out, const TextTable::Block* b, int i) {
    if (b->kind[i] == 0) {
      out += "null";
      return;
    }
    json::put_string(out, b->data(i), b->length[i], b->kind[i]);
  }

  /// Pass 3 as JSON: the pages of refs [from, to), comma-separated.
  static void json_pages(std::string& out, const Refs& refs, size_t from, size_t to,
                         const char* tier, bool scored, Dumped& dumped, int64_t* tokens) {
    for (size_t r = from; r < to; ++r) {
      const Ref& ref = refs.refs[r];
      const TextTable::Block* b = ref.block;
      const TextTable::Block* chain = ref.chain;
      *tokens += (b->chars + (chain != nullptr ? chain->chars : 0) + 3) / 4;
      if (r > from) out += ',';
      out += "{\"page_id\":";
      json::put_int(out, ref.key);
      out += ",\"user_input\":";
      json_text(out, b, 0);
      out += ",\"agent_response\":";
      json_text(out, b, 1);
      out += ",\"timestamp\":";
      json::put_float(out, b->timestamp);
      out += ",\"tier\":\"";
      out += tier;
      out += "\",\"score\":";
      if (scored) {
        json::put_float(out, static_cast<double>(ref.score));
      } else {
        out += "null";
      }
      out += ",\"meta\":";
      if (chain != nullptr) {
        json_text(out, chain, 0);
      } else {
        out += "null";
      }
      out += ",\"extra\":";
      out += dumped(ref.extra);
      out += '}';
    }
  }

  /// Pass 3 as JSON: the knowledge entries of refs [from, to), comma-separated.
  static void json_entries(std::string& out, const Refs& refs, size_t from, size_t to,
                           int64_t* tokens) {
    for (size_t r = from; r < to; ++r) {
      const Ref& ref = refs.refs[r];
      *tokens += (ref.block->chars + 3) / 4;
      if (r > from) out += ',';
      out += "{\"entry_id\":";
      json::put_int(out, ref.key);
      out += ",\"text\":";
      json_text(out, ref.block, 0);
      out += ",\"score\":";
      json::put_float(out, static_cast<double>(ref.score));
      out += ",\"sources\":null}";
    }
  }

  /// A copy of the user's profile (each Retrieval owns its own), or a new empty dict.
  static py::object copy_profile(PyObject* profiles, PyObject* uid) {
    PyObject* found = PyDict_GetItemWithError(profiles, uid);  // borrowed
    if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
    PyObject* copy = found != nullptr && PyDict_Check(found) && PyDict_GET_SIZE(found) > 0
                         ? PyDict_Copy(found)
                         : PyDict_New();
    if (copy == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(copy);
  }

  /// Pass 1, one row of query i's hits. Ids < 0 are padding: for pages (`ordered`) they end
  /// the row, for knowledge entries they may be anywhere (skipped). `ids_wanted`: each ref
  /// gets its id as a Python int (for the objects).
  static void take_hits(const TextTable& table, const Hits& h, int64_t i, bool ordered,
                        bool ids_wanted, Refs& refs) {
    refs.start.push_back(refs.refs.size());
    const int64_t* ids = h.id_row(i);
    const float* scores = h.score_row(i);
    for (int64_t j = 0; j < h.k(); ++j) {
      if (ids[j] < 0) {
        if (ordered) break;
        continue;
      }
      PyObject* id = nullptr;  // the objects' id field; a JSON body writes the key itself
      if (ids_wanted && (id = PyLong_FromLongLong(ids[j])) == nullptr) {
        throw py::error_already_set();
      }
      refs.refs.push_back({id, ids[j], nullptr, nullptr, scores[j], nullptr});
      table.prefetch(ids[j]);
    }
  }

  /// Pass 1, the short-term pages of `user`, oldest first: its `pending` (pushed out of STM,
  /// not placed in MTM yet: in no other section until then), then its `stm` (page ids, any
  /// iterables).
  void take_stm(const TextTable& views, PyObject* user, Refs& refs) const {
    refs.start.push_back(refs.refs.size());
    py::handle record(user);
    for (const py::str& attr : {pending_attr_, stm_attr_}) {
      py::object ids = record.attr(attr);
      for (py::handle pid : ids) {
        const int64_t key = PyLong_AsLongLong(pid.ptr());
        if (key == -1 && PyErr_Occurred()) throw py::error_already_set();
        refs.refs.push_back({Py_NewRef(pid.ptr()), key, nullptr, nullptr, 0.f, nullptr});
        views.prefetch(key);
      }
    }
  }

  /// Pass 2: the records of refs [from, to) and, with `chains`, the chain records they link
  /// to (a link the chain table lacks shows no meta); KeyError naming an id the table lacks
  /// (the Python side then reads the batch's missing records from the store and assembles
  /// again).
  static void find(const TextTable& table, const TextTable* chains, Refs& refs, size_t from,
                   size_t to) {
    for (size_t r = from; r < to; ++r) {
      const TextTable::Slot* s = table.find(refs.refs[r].key);
      if (s == nullptr) {
        PyErr_SetObject(PyExc_KeyError, refs.refs[r].id);
        throw py::error_already_set();
      }
      refs.refs[r].block = s->block;
      refs.refs[r].extra = s->extra;
      prefetch_block(s->block);
      if (chains != nullptr && s->block->link >= 0) {
        const TextTable::Slot* c = chains->find(s->block->link);
        if (c != nullptr) {
          refs.refs[r].chain = c->block;
          prefetch_block(c->block);
        }
      }
    }
  }

  /// A text of a block as a new str, or throw.
  static PyObject* text(const TextTable::Block* b, int i) {
    PyObject* t = TextTable::text(b, i);
    if (t == nullptr) throw py::error_already_set();
    return t;
  }

  /// Pass 3: the RetrievedPage objects of refs [from, to) (``scored``: MTM pages; STM pages'
  /// score is None).
  py::object build_pages(Refs& refs, size_t from, size_t to, PyObject* tier, bool scored,
                         int64_t* tokens) const {
    py::list out(static_cast<Py_ssize_t>(to - from));
    for (size_t r = from; r < to; ++r) {
      Ref& ref = refs.refs[r];
      const TextTable::Block* b = ref.block;
      const TextTable::Block* chain = ref.chain;
      *tokens += (b->chars + (chain != nullptr ? chain->chars : 0) + 3) / 4;
      PyObject* values[8] = {nullptr};
      values[1] = TextTable::text(b, 0);
      values[2] = TextTable::text(b, 1);
      values[3] = PyFloat_FromDouble(b->timestamp);
      values[5] = scored ? PyFloat_FromDouble(ref.score) : Py_NewRef(Py_None);
      values[6] = chain != nullptr ? TextTable::text(chain, 0) : Py_NewRef(Py_None);
      if (!values[1] || !values[2] || !values[3] || !values[5] || !values[6]) {
        for (PyObject* v : values) Py_XDECREF(v);
        throw py::error_already_set();
      }
      values[0] = std::exchange(ref.id, nullptr);
      values[4] = Py_NewRef(tier);
      values[7] = Py_NewRef(ref.extra != nullptr ? ref.extra : Py_None);
      PyObject* p = page_.make(values);
      if (p == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(r - from), p);
    }
    return std::move(out);
  }

  /// Pass 3: the KnowledgeEntry objects of refs [from, to).
  py::object build_entries(Refs& refs, size_t from, size_t to, int64_t* tokens) const {
    py::list out(static_cast<Py_ssize_t>(to - from));
    for (size_t r = from; r < to; ++r) {
      Ref& ref = refs.refs[r];
      *tokens += (ref.block->chars + 3) / 4;
      PyObject* values[4] = {nullptr, TextTable::text(ref.block, 0),
                             PyFloat_FromDouble(ref.score), nullptr};
      if (!values[1] || !values[2]) {
        for (PyObject* v : values) Py_XDECREF(v);
        throw py::error_already_set();
      }
      values[0] = std::exchange(ref.id, nullptr);
      values[3] = Py_NewRef(Py_None);
      PyObject* e = entry_.make(values);
      if (e == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(r - from), e);
    }
    return std::move(out);
  }

  SlotLayout page_, entry_, retrieval_;
  py::str mtm_, stm_, stm_attr_, pending_attr_;
};

}  // namespace

void register_assembly(py::module_& m) {
  py::class_<Assembler>(m, "Assembler",
                        "Builds a retrieval batch's Retrieval objects (memoryos_gpu.engine."
                        "assembly): one call per batch.")
      .def(py::init<py::type, py::type, py::type, py::str, py::str>(), py::arg("page_cls"),
           py::arg("entry_cls"), py::arg("retrieval_cls"), py::arg("mtm"), py::arg("stm"))
      .def("batch", &Assembler::batch, py::arg("cleaned"), py::arg("users"), py::arg("views"),
           py::arg("chains"), py::arg("texts"), py::arg("p_ids"), py::arg("p_scores"),
           py::arg("uk_ids"), py::arg("uk_scores"), py::arg("ak_ids"), py::arg("ak_scores"),
           py::arg("profiles"), py::arg("profile_tokens"),
           "(list of Retrieval, total prompt tokens) of a batch; KeyError names a page or "
           "entry the views lack.")
      .def("bodies", &Assembler::bodies, py::arg("cleaned"), py::arg("users"), py::arg("views"),
           py::arg("chains"), py::arg("texts"), py::arg("p_ids"), py::arg("p_scores"),
           py::arg("uk_ids"), py::arg("uk_scores"), py::arg("ak_ids"), py::arg("ak_scores"),
           py::arg("profiles"), py::arg("profile_tokens"), py::arg("dumps"),
           "(list of JSON bytes, total prompt tokens): the same batch as the bodies of the "
           "retrieval route (less user_id and known_user); KeyError as batch.");
}

}  // namespace memoryos
