// memoryos-gpu: TextTable (see text_table.h).
#include "text_table.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "../host/codepoints.h"

namespace memoryos {
namespace {

namespace py = pybind11;

constexpr size_t kInitialSlots = 1024;

size_t header_bytes() { return (sizeof(TextTable::Block) + 3) & ~size_t{3}; }

/// A text argument: str or None (anything else is refused before the table changes).
void check_text(PyObject* t, const char* what) {
  if (t != Py_None && !PyUnicode_Check(t)) {
    throw py::type_error(std::string(what) + " must be a str or None");
  }
  if (t != Py_None && PyUnicode_READY(t) < 0) throw py::error_already_set();
}

/// A text's size in quarter tokens (page_views.token_quarters): a code point each, four for a
/// one-token one (cp::is_one_token: the generated table page_views' regex is built from too).
/// A kind-1 text (Latin-1) holds none of those: its length.
int64_t token_quarters(PyObject* t) {
  const Py_ssize_t n = PyUnicode_GET_LENGTH(t);
  const int kind = PyUnicode_KIND(t);
  if (kind == PyUnicode_1BYTE_KIND) return n;
  const void* data = PyUnicode_DATA(t);
  int64_t wide = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    wide += cp::is_one_token(PyUnicode_READ(kind, data, i)) ? 1 : 0;
  }
  return n + 3 * wide;
}

}  // namespace

const uint8_t* TextTable::Block::data(int i) const {
  const auto* p = reinterpret_cast<const uint8_t*>(this) + header_bytes();
  for (int j = 0; j < i; ++j) p += static_cast<size_t>(length[j]) * kind[j];
  return p;
}

TextTable::TextTable() : slots_(kInitialSlots) {}

TextTable::~TextTable() {
  for (Slot& s : slots_.slots()) {
    if (s.used()) release(s);
  }
}

const TextTable::Slot* TextTable::find(int64_t id) const {
  const Slot& s = slots_[slots_.locate(id)];
  return s.used() ? &s : nullptr;
}

void TextTable::release(Slot& slot) {
  const Block* b = slot.block;
  size_t bytes = header_bytes();
  for (int i = 0; i < kTexts; ++i) bytes += static_cast<size_t>(b->length[i]) * b->kind[i];
  block_bytes_ -= bytes;
  std::free(slot.block);
  Py_XDECREF(slot.extra);
  slot = Slot{0, nullptr, nullptr};
}

void TextTable::put(int64_t id, PyObject* const texts[kTexts], double timestamp,
                    PyObject* extra, int64_t link) {
  size_t bytes = header_bytes();
  for (int i = 0; i < kTexts; ++i) {
    check_text(texts[i], "a text");
    if (texts[i] != Py_None) {
      bytes += static_cast<size_t>(PyUnicode_GET_LENGTH(texts[i])) * PyUnicode_KIND(texts[i]);
    }
  }
  const size_t at = slots_.locate_for_insert(id);
  auto* b = static_cast<Block*>(std::malloc(bytes));
  if (b == nullptr) throw std::bad_alloc();
  b->timestamp = timestamp;
  b->link = link;
  int64_t chars = 0;
  auto* out = reinterpret_cast<uint8_t*>(b) + header_bytes();
  for (int i = 0; i < kTexts; ++i) {
    PyObject* t = texts[i];
    if (t == Py_None) {
      b->length[i] = 0, b->kind[i] = 0, b->ascii[i] = 0;
      continue;
    }
    const Py_ssize_t n = PyUnicode_GET_LENGTH(t);
    b->length[i] = static_cast<uint32_t>(n);
    b->kind[i] = static_cast<uint8_t>(PyUnicode_KIND(t));
    b->ascii[i] = PyUnicode_IS_ASCII(t) ? 1 : 0;
    std::memcpy(out, PyUnicode_DATA(t), static_cast<size_t>(n) * b->kind[i]);
    out += static_cast<size_t>(n) * b->kind[i];
    chars += token_quarters(t);
  }
  b->chars = chars;
  block_bytes_ += bytes;
  Py_XINCREF(extra);
  if (slots_[at].used()) {
    release(slots_[at]);
    slots_[at] = Slot{id, b, extra};
  } else {
    slots_.fill(at, Slot{id, b, extra});
  }
}

bool TextTable::erase(int64_t id) {
  const size_t i = slots_.locate(id);
  if (!slots_[i].used()) return false;
  release(slots_[i]);
  slots_.erase(i);
  return true;
}

bool TextTable::set_text(int64_t id, int i, PyObject* text) {
  const Slot* s = find(id);
  if (s == nullptr) return false;
  PyObject* texts[kTexts];
  py::object held[kTexts];
  for (int j = 0; j < kTexts; ++j) {
    if (j == i) {
      texts[j] = text;
      continue;
    }
    held[j] = py::reinterpret_steal<py::object>(TextTable::text(s->block, j));
    if (!held[j]) throw py::error_already_set();
    texts[j] = held[j].ptr();
  }
  py::object extra = py::reinterpret_borrow<py::object>(s->extra);  // kept across put
  put(id, texts, s->block->timestamp, extra.ptr(), s->block->link);
  return true;
}

bool TextTable::set_link(int64_t id, int64_t link) {
  const Slot* s = find(id);
  if (s == nullptr) return false;
  s->block->link = link;
  return true;
}

PyObject* TextTable::text(const Block* b, int i) {
  if (b->kind[i] == 0) return Py_NewRef(Py_None);
  const Py_UCS4 maxchar = b->ascii[i] ? 127 : b->kind[i] == 1 ? 255 : b->kind[i] == 2 ? 0xFFFF : 0x10FFFF;
  PyObject* s = PyUnicode_New(b->length[i], maxchar);
  if (s == nullptr) return nullptr;
  std::memcpy(PyUnicode_DATA(s), b->data(i), static_cast<size_t>(b->length[i]) * b->kind[i]);
  return s;
}

namespace {

/// (text 0, text 1, timestamp, extra, link, characters of the texts).
py::object record(const TextTable::Slot& s) {
  py::object t[TextTable::kTexts];
  for (int i = 0; i < TextTable::kTexts; ++i) {
    t[i] = py::reinterpret_steal<py::object>(TextTable::text(s.block, i));
    if (!t[i]) throw py::error_already_set();
  }
  py::object extra = s.extra != nullptr ? py::reinterpret_borrow<py::object>(s.extra) : py::none();
  return py::make_tuple(t[0], t[1], s.block->timestamp, extra, s.block->link, s.block->chars);
}

void put_py(TextTable& table, int64_t id, py::handle t0, py::handle t1, double ts,
            py::handle extra, int64_t link) {
  PyObject* texts[TextTable::kTexts] = {t0.ptr(), t1.ptr()};
  table.put(id, texts, ts, extra.is_none() ? nullptr : extra.ptr(), link);
}

}  // namespace

void register_text_table(py::module_& m) {
  py::class_<TextTable>(m, "TextTable",
                        "Records by int64 id: two texts (str or None), a timestamp, a link (an "
                        "id in another table, -1: none), their characters and one shared "
                        "object (memoryos_gpu.page_views).")
      .def(py::init<>())
      .def("put", &put_py, py::arg("id"), py::arg("text0"), py::arg("text1"),
           py::arg("timestamp"), py::arg("extra"), py::arg("link") = -1,
           "Insert or replace a record (texts: str or None; extra: None for none).")
      .def(
          "put_many",
          [](TextTable& t, py::sequence ids, py::sequence t0, py::sequence t1, py::sequence ts,
             py::sequence extra, py::sequence links) {
            const size_t n = ids.size();
            if (t0.size() != n || t1.size() != n || ts.size() != n || extra.size() != n ||
                links.size() != n) {
              throw py::value_error("put_many: every sequence must have one item per id");
            }
            for (size_t i = 0; i < n; ++i) {
              put_py(t, ids[i].cast<int64_t>(), t0[i], t1[i], ts[i].cast<double>(), extra[i],
                     links[i].cast<int64_t>());
            }
          },
          py::arg("ids"), py::arg("text0"), py::arg("text1"), py::arg("timestamps"),
          py::arg("extras"), py::arg("links"), "put() of many records.")
      .def(
          "get",
          [](const TextTable& t, int64_t id) -> py::object {
            const TextTable::Slot* s = t.find(id);
            return s == nullptr ? py::none() : record(*s);
          },
          py::arg("id"), "(text0, text1, timestamp, extra, link, characters), or None.")
      .def(
          "text",
          [](const TextTable& t, int64_t id) -> py::object {
            const TextTable::Slot* s = t.find(id);
            if (s == nullptr) throw py::key_error(std::to_string(id));
            return py::reinterpret_steal<py::object>(TextTable::text(s->block, 0));
          },
          py::arg("id"), "text0 of a record (KeyError when there is none).")
      .def("pop", &TextTable::erase, py::arg("id"), "Remove a record; False when there was none.")
      .def(
          "set_text",
          [](TextTable& t, int64_t id, int i, py::handle text) {
            if (i < 0 || i >= TextTable::kTexts) throw py::index_error("text index 0-1");
            check_text(text.ptr(), "text");
            return t.set_text(id, i, text.ptr());
          },
          py::arg("id"), py::arg("index"), py::arg("text"),
          "Replace one text of a record; False when there is no record.")
      .def(
          "link",
          [](const TextTable& t, int64_t id) -> py::object {
            const TextTable::Slot* s = t.find(id);
            if (s == nullptr) return py::none();
            return py::int_(s->block->link);
          },
          py::arg("id"), "The link of a record (-1: none), or None when there is no record.")
      .def("set_link", &TextTable::set_link, py::arg("id"), py::arg("link"),
           "Replace the link of a record; False when there is no record.")
      .def(
          "set_links",
          [](TextTable& t, py::sequence ids, py::sequence links) {
            const size_t n = ids.size();
            if (links.size() != n) {
              throw py::value_error("set_links: one link per id");
            }
            size_t done = 0;
            for (size_t i = 0; i < n; ++i) {
              done += t.set_link(ids[i].cast<int64_t>(), links[i].cast<int64_t>()) ? 1 : 0;
            }
            return done;
          },
          py::arg("ids"), py::arg("links"),
          "set_link() of many records; returns how many had a record.")
      .def("__contains__", [](const TextTable& t, int64_t id) { return t.find(id) != nullptr; })
      .def("__len__", &TextTable::size)
      .def("nbytes", &TextTable::nbytes, "Bytes held (slots and texts).");
}

}  // namespace memoryos
