// memoryos-gpu: a retrieval batch's result objects, built in one native call.
//
// Why native: the kernels leave [B, k] arrays; what a caller gets is one Retrieval per query
// with ~20 RetrievedPage / KnowledgeEntry objects in it. Built in Python that was ~0.5-0.9 us
// an object (an allocation and eight attribute stores through the interpreter): most of a
// query's host time once the kernels and BM25 are native. Here the same objects are made by
// the type's own allocator and their slots filled directly, with the texts taken from the
// in-memory views by reference (nothing is copied), and the loop over the batch is C++.
//
// The classes are the package's slots dataclasses (memoryos_gpu.types); SlotLayout reads the
// offsets of their member descriptors once and refuses a class whose fields are not plain
// object slots, so a change to those classes fails loudly at import, not with corrupt objects.
#include "assembly_bindings.h"

#include <Python.h>
#include <structmember.h>

#include <cstdint>
#include <string>
#include <type_traits>
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

/// One returned page or knowledge entry, as the first pass finds it: its id (a new reference,
/// handed on to the object built for it), the view or text it comes from (borrowed from the
/// views) and its score (unused for STM pages, which have none).
struct Ref {
  PyObject* id;
  PyObject* src;
  float score;
};

/// The refs of a batch: query i's MTM pages, STM pages, user and assistant entries are the
/// four ranges from start[4 i] to start[4 i + 4]. Owns the ids not yet handed on.
struct Refs {
  std::vector<Ref> refs;
  std::vector<size_t> start;
  Refs() = default;
  Refs(const Refs&) = delete;
  Refs& operator=(const Refs&) = delete;
  ~Refs() {
    for (Ref& r : refs) Py_XDECREF(r.id);
  }
};

/// Ask for the cache line holding an object's header (its reference count and type).
inline void prefetch(const PyObject* o) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(o, 1);  // for writing: the reference count will change
#endif
}

/// The batch assembler: pages, entries and Retrieval objects for every query.
///
/// Three passes over the batch, because the views are spread over the heap: a batch's ~1,300
/// pages of 20,000 users touch ~6,000 objects (each view's tuple, texts, timestamp, metadata)
/// that are mostly not in cache, and building the objects in one pass waited for each miss
/// in turn (14 us a query at 1,000 users against 3 us on a cached batch). Pass 1 looks every
/// returned page and entry up and asks for its view; pass 2 asks for the objects each view
/// holds; pass 3 builds, by then mostly from cache, with the misses overlapped.
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
        stm_attr_("stm") {}

  py::tuple batch(py::list cleaned, py::list users, py::dict views, py::dict texts, py::array p_ids,
                  py::array p_scores, py::array uk_ids, py::array uk_scores, py::array ak_ids,
                  py::array ak_scores, py::dict profiles, py::object profile_tokens) const {
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
    for (int64_t i = 0; i < b; ++i) {
      PyObject* pair = PyList_GET_ITEM(cleaned.ptr(), i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        throw py::value_error("cleaned must hold (user_id, query) tuples");
      }
    }
    Refs refs;
    refs.refs.reserve(static_cast<size_t>(b) * 24);
    refs.start.reserve(static_cast<size_t>(4 * b + 1));
    for (int64_t i = 0; i < b; ++i) {
      find_pages(views.ptr(), pages, i, refs);
      find_stm(views.ptr(), PyList_GET_ITEM(users.ptr(), i), refs);
      find_entries(texts.ptr(), uk, i, refs);
      find_entries(texts.ptr(), ak, i, refs);
    }
    refs.start.push_back(refs.refs.size());
    prefetch_view_fields(refs, b);
    py::list out(b);
    int64_t total = 0;
    for (int64_t i = 0; i < b; ++i) {
      PyObject* pair = PyList_GET_ITEM(cleaned.ptr(), i);
      const size_t* at = &refs.start[static_cast<size_t>(4 * i)];
      int64_t tokens = 0;
      py::object mtm = build_pages(refs, at[0], at[1], mtm_.ptr(), true, &tokens);
      py::object stm_pages = build_pages(refs, at[1], at[2], stm_.ptr(), false, &tokens);
      py::object u_entries = build_entries(refs, at[2], at[3], &tokens);
      py::object a_entries = build_entries(refs, at[3], at[4], &tokens);
      PyObject* uid = PyTuple_GET_ITEM(pair, 0);
      PyObject* found = PyDict_GetItemWithError(profiles.ptr(), uid);  // borrowed
      if (found == nullptr && PyErr_Occurred()) throw py::error_already_set();
      py::object profile = py::reinterpret_steal<py::object>(
          found != nullptr && PyDict_Check(found) && PyDict_GET_SIZE(found) > 0
              ? PyDict_Copy(found)
              : PyDict_New());
      if (!profile) throw py::error_already_set();
      if (PyDict_GET_SIZE(profile.ptr()) > 0) tokens += profile_tokens(profile).cast<int64_t>();
      total += tokens;
      PyObject* values[8] = {Py_NewRef(uid),
                             Py_NewRef(PyTuple_GET_ITEM(pair, 1)),
                             stm_pages.release().ptr(),
                             mtm.release().ptr(),
                             profile.release().ptr(),
                             u_entries.release().ptr(),
                             a_entries.release().ptr(),
                             PyLong_FromLongLong(tokens)};
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

  /// `key`'s value in `dict` (borrowed), prefetched; KeyError naming the key when it is
  /// missing (the Python side then reads the batch's missing views from the store and
  /// assembles again).
  static PyObject* lookup(PyObject* dict, PyObject* key) {
    PyObject* found = PyDict_GetItemWithError(dict, key);  // borrowed
    if (found == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
      throw py::error_already_set();
    }
    prefetch(found);
    return found;
  }

  /// Pass 1, query i's MTM pages: ids < 0 are padding and end the row.
  static void find_pages(PyObject* views, const Hits& h, int64_t i, Refs& refs) {
    refs.start.push_back(refs.refs.size());
    const int64_t* ids = h.id_row(i);
    const float* scores = h.score_row(i);
    for (int64_t j = 0; j < h.k() && ids[j] >= 0; ++j) {
      refs.refs.push_back({PyLong_FromLongLong(ids[j]), nullptr, scores[j]});
      if (refs.refs.back().id == nullptr) throw py::error_already_set();
      refs.refs.back().src = lookup(views, refs.refs.back().id);
    }
  }

  /// Pass 1, the STM pages of `user` (its `stm`: page ids, oldest first, any iterable).
  void find_stm(PyObject* views, PyObject* user, Refs& refs) const {
    refs.start.push_back(refs.refs.size());
    py::object ids = py::reinterpret_borrow<py::object>(user).attr(stm_attr_);
    for (py::handle pid : ids) {
      refs.refs.push_back({Py_NewRef(pid.ptr()), nullptr, 0.f});
      refs.refs.back().src = lookup(views, pid.ptr());
    }
  }

  /// Pass 1, query i's knowledge entries of one list: ids < 0 are padding (skipped).
  static void find_entries(PyObject* texts, const Hits& h, int64_t i, Refs& refs) {
    refs.start.push_back(refs.refs.size());
    const int64_t* ids = h.id_row(i);
    const float* scores = h.score_row(i);
    for (int64_t j = 0; j < h.k(); ++j) {
      if (ids[j] < 0) continue;
      refs.refs.push_back({PyLong_FromLongLong(ids[j]), nullptr, scores[j]});
      if (refs.refs.back().id == nullptr) throw py::error_already_set();
      PyObject* text = lookup(texts, refs.refs.back().id);
      if (!PyUnicode_Check(text)) throw py::type_error("a knowledge text must be a str");
      refs.refs.back().src = text;
    }
  }

  /// Pass 2: ask for every object the found views hold (pass 3 takes a reference to each).
  static void prefetch_view_fields(const Refs& refs, int64_t b) {
    for (int64_t i = 0; i < b; ++i) {
      const size_t* at = &refs.start[static_cast<size_t>(4 * i)];
      for (size_t r = at[0]; r < at[2]; ++r) {  // MTM and STM pages
        PyObject* view = refs.refs[r].src;
        if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 6) continue;  // refused in pass 3
        for (Py_ssize_t f = 0; f < 5; ++f) prefetch(PyTuple_GET_ITEM(view, f));
      }
    }
  }

  /// Pass 3: the RetrievedPage objects of refs [from, to) (``scored``: MTM pages; STM pages'
  /// score is None).
  py::object build_pages(Refs& refs, size_t from, size_t to, PyObject* tier, bool scored,
                         int64_t* tokens) const {
    py::list out(static_cast<Py_ssize_t>(to - from));
    for (size_t r = from; r < to; ++r) {
      Ref& ref = refs.refs[r];
      PyObject* view = ref.src;
      if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 6) {
        throw py::type_error("a page view must be a PageView of 6 fields");
      }
      *tokens += PyLong_AsLongLong(PyTuple_GET_ITEM(view, 5));
      PyObject* score = scored ? PyFloat_FromDouble(ref.score) : Py_NewRef(Py_None);
      if (score == nullptr) throw py::error_already_set();
      PyObject* values[8] = {std::exchange(ref.id, nullptr),
                             Py_NewRef(PyTuple_GET_ITEM(view, 0)),
                             Py_NewRef(PyTuple_GET_ITEM(view, 1)),
                             Py_NewRef(PyTuple_GET_ITEM(view, 2)),
                             Py_NewRef(tier),
                             score,
                             Py_NewRef(PyTuple_GET_ITEM(view, 3)),
                             Py_NewRef(PyTuple_GET_ITEM(view, 4))};
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
      *tokens += (PyUnicode_GET_LENGTH(ref.src) + 3) / 4;
      PyObject* score = PyFloat_FromDouble(ref.score);
      if (score == nullptr) throw py::error_already_set();
      PyObject* values[4] = {std::exchange(ref.id, nullptr), Py_NewRef(ref.src), score,
                             Py_NewRef(Py_None)};
      PyObject* e = entry_.make(values);
      if (e == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(r - from), e);
    }
    return std::move(out);
  }

  SlotLayout page_, entry_, retrieval_;
  py::str mtm_, stm_, stm_attr_;
};

}  // namespace

void register_assembly(py::module_& m) {
  py::class_<Assembler>(m, "Assembler",
                        "Builds a retrieval batch's Retrieval objects (memoryos_gpu.engine."
                        "assembly): one call per batch.")
      .def(py::init<py::type, py::type, py::type, py::str, py::str>(), py::arg("page_cls"),
           py::arg("entry_cls"), py::arg("retrieval_cls"), py::arg("mtm"), py::arg("stm"))
      .def("batch", &Assembler::batch, py::arg("cleaned"), py::arg("users"), py::arg("views"),
           py::arg("texts"), py::arg("p_ids"), py::arg("p_scores"), py::arg("uk_ids"),
           py::arg("uk_scores"), py::arg("ak_ids"), py::arg("ak_scores"), py::arg("profiles"),
           py::arg("profile_tokens"),
           "(list of Retrieval, total prompt tokens) of a batch; KeyError names a page or "
           "entry the views lack.");
}

}  // namespace memoryos
