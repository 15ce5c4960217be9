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

/// The batch assembler: pages, entries and Retrieval objects for every query.
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
    auto pi = checked<int64_t>(p_ids, b, "page ids");
    auto ps = checked<float>(p_scores, b, "page scores");
    auto ui = checked<int64_t>(uk_ids, b, "user knowledge ids");
    auto us = checked<float>(uk_scores, b, "user knowledge scores");
    auto ai = checked<int64_t>(ak_ids, b, "assistant knowledge ids");
    auto as = checked<float>(ak_scores, b, "assistant knowledge scores");
    if (pi.shape[1] != ps.shape[1] || ui.shape[1] != us.shape[1] || ai.shape[1] != as.shape[1]) {
      throw py::value_error("ids and scores must have the same shape");
    }
    py::list out(b);
    int64_t total = 0;
    for (int64_t i = 0; i < b; ++i) {
      PyObject* pair = PyList_GET_ITEM(cleaned.ptr(), i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        throw py::value_error("cleaned must hold (user_id, query) tuples");
      }
      int64_t tokens = 0;
      py::object mtm = pages(views, row<int64_t>(pi, i), row<float>(ps, i), pi.shape[1], mtm_,
                             &tokens);
      py::object user_stm = py::reinterpret_borrow<py::object>(PyList_GET_ITEM(users.ptr(), i))
                                .attr(stm_attr_);  // the user's STM page ids, oldest first
      py::object stm_pages = pages_of(views, user_stm.ptr(), &tokens);
      py::object uk = entries(texts, row<int64_t>(ui, i), row<float>(us, i), ui.shape[1], &tokens);
      py::object ak = entries(texts, row<int64_t>(ai, i), row<float>(as, i), ai.shape[1], &tokens);
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
                             uk.release().ptr(),
                             ak.release().ptr(),
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
  template <typename T>
  static const T* row(const py::buffer_info& info, int64_t i) {
    return static_cast<const T*>(info.ptr) + i * info.shape[1];
  }

  /// One RetrievedPage for view `pid` (KeyError when the views lack it: the Python side then
  /// reads the batch's missing views from the store and assembles again).
  PyObject* page(PyObject* views, PyObject* pid, PyObject* score, PyObject* tier,
                 int64_t* tokens) const {
    PyObject* view = PyDict_GetItemWithError(views, pid);  // borrowed
    if (view == nullptr) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pid);
      Py_DECREF(score);
      return nullptr;
    }
    if (!PyTuple_Check(view) || PyTuple_GET_SIZE(view) != 6) {
      PyErr_SetString(PyExc_TypeError, "a page view must be a PageView of 6 fields");
      Py_DECREF(score);
      return nullptr;
    }
    *tokens += PyLong_AsLongLong(PyTuple_GET_ITEM(view, 5));
    PyObject* values[8] = {Py_NewRef(pid),
                           Py_NewRef(PyTuple_GET_ITEM(view, 0)),
                           Py_NewRef(PyTuple_GET_ITEM(view, 1)),
                           Py_NewRef(PyTuple_GET_ITEM(view, 2)),
                           Py_NewRef(tier),
                           score,
                           Py_NewRef(PyTuple_GET_ITEM(view, 3)),
                           Py_NewRef(PyTuple_GET_ITEM(view, 4))};
    return page_.make(values);
  }

  /// The MTM pages of one query: ids < 0 are padding and end the row.
  py::object pages(const py::dict& views, const int64_t* ids, const float* scores, int64_t k,
                   const py::str& tier, int64_t* tokens) const {
    py::list out;
    for (int64_t j = 0; j < k && ids[j] >= 0; ++j) {
      py::object pid = py::reinterpret_steal<py::object>(PyLong_FromLongLong(ids[j]));
      PyObject* score = PyFloat_FromDouble(scores[j]);
      if (!pid || score == nullptr) throw py::error_already_set();
      PyObject* p = page(views.ptr(), pid.ptr(), score, tier.ptr(), tokens);
      if (p == nullptr) throw py::error_already_set();
      out.append(py::reinterpret_steal<py::object>(p));
    }
    return std::move(out);
  }

  /// The STM pages of one query: the user's STM page ids (any iterable), score None.
  py::object pages_of(const py::dict& views, PyObject* page_ids, int64_t* tokens) const {
    py::list out;
    for (py::handle pid : py::reinterpret_borrow<py::object>(page_ids)) {
      PyObject* p = page(views.ptr(), pid.ptr(), Py_NewRef(Py_None), stm_.ptr(), tokens);
      if (p == nullptr) throw py::error_already_set();
      out.append(py::reinterpret_steal<py::object>(p));
    }
    return std::move(out);
  }

  /// The knowledge entries of one query: ids < 0 are padding (skipped).
  py::object entries(const py::dict& texts, const int64_t* ids, const float* scores, int64_t k,
                     int64_t* tokens) const {
    py::list out;
    for (int64_t j = 0; j < k; ++j) {
      if (ids[j] < 0) continue;
      py::object eid = py::reinterpret_steal<py::object>(PyLong_FromLongLong(ids[j]));
      if (!eid) throw py::error_already_set();
      PyObject* text = PyDict_GetItemWithError(texts.ptr(), eid.ptr());  // borrowed
      if (text == nullptr) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, eid.ptr());
        throw py::error_already_set();
      }
      if (!PyUnicode_Check(text)) throw py::type_error("a knowledge text must be a str");
      *tokens += (PyUnicode_GET_LENGTH(text) + 3) / 4;
      PyObject* values[4] = {eid.release().ptr(), Py_NewRef(text),
                             PyFloat_FromDouble(scores[j]), Py_NewRef(Py_None)};
      if (values[2] == nullptr) {
        for (PyObject* v : values) Py_XDECREF(v);
        throw py::error_already_set();
      }
      PyObject* e = entry_.make(values);
      if (e == nullptr) throw py::error_already_set();
      out.append(py::reinterpret_steal<py::object>(e));
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
