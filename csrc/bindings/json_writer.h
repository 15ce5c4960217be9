// memoryos-gpu: the few JSON values a retrieval's body holds, written into a std::string.
//
// Strings come as CPython stores them (n code points of 1, 2 or 4 bytes: the text tables keep
// that form), so UTF-8 is produced here; ASCII runs without a character to escape are copied
// whole. Escapes are JSON's (\" \\ \b \f \n \r \t, other controls as \u00XX); a lone surrogate
// (never in engine text: validation replaces them) is written as its \uXXXX escape. Numbers:
// integers as such, floats as the shortest text that reads back to the same double, with ".0"
// when that text would read as an integer, so a client sees a float where it saw one before;
// a non-finite float is null (as orjson writes it).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace memoryos::json {

inline void put_escape(std::string& out, uint32_t c) {
  static const char kHex[] = "0123456789abcdef";
  out += "\\u";
  for (int shift = 12; shift >= 0; shift -= 4) out += kHex[(c >> shift) & 15u];
}

/// One code point, escaped or UTF-8 encoded.
inline void put_code_point(std::string& out, uint32_t c) {
  if (c < 0x80) {
    switch (c) {
      case '"': out += "\\\""; return;
      case '\\': out += "\\\\"; return;
      case '\b': out += "\\b"; return;
      case '\f': out += "\\f"; return;
      case '\n': out += "\\n"; return;
      case '\r': out += "\\r"; return;
      case '\t': out += "\\t"; return;
      default:
        if (c < 0x20) {
          put_escape(out, c);
        } else {
          out += static_cast<char>(c);
        }
        return;
    }
  }
  if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
  } else if (c >= 0xD800 && c <= 0xDFFF) {
    put_escape(out, c);
    return;
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
  }
  out += static_cast<char>(0x80 | (c & 0x3F));
}

inline bool plain_ascii(uint8_t c) { return c >= 0x20 && c < 0x80 && c != '"' && c != '\\'; }

/// A JSON string of `n` code points stored `kind` bytes each (CPython's 1, 2 or 4).
inline void put_string(std::string& out, const void* data, size_t n, int kind) {
  out += '"';
  if (kind == 1) {
    const auto* p = static_cast<const uint8_t*>(data);
    size_t i = 0;
    while (i < n) {
      size_t j = i;
      while (j < n && plain_ascii(p[j])) ++j;
      out.append(reinterpret_cast<const char*>(p + i), j - i);
      if (j < n) put_code_point(out, p[j++]);
      i = j;
    }
  } else if (kind == 2) {
    const auto* p = static_cast<const uint16_t*>(data);
    for (size_t i = 0; i < n; ++i) put_code_point(out, p[i]);
  } else {
    const auto* p = static_cast<const uint32_t*>(data);
    for (size_t i = 0; i < n; ++i) put_code_point(out, p[i]);
  }
  out += '"';
}

inline void put_int(std::string& out, int64_t v) {
  char buf[24];
  const auto end = std::to_chars(buf, buf + sizeof(buf), v).ptr;
  out.append(buf, static_cast<size_t>(end - buf));
}

inline void put_float(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[40];
  const auto end = std::to_chars(buf, buf + sizeof(buf), v).ptr;
  const std::string_view text(buf, static_cast<size_t>(end - buf));
  out.append(text);
  if (text.find_first_of(".en") == std::string_view::npos) out += ".0";
}

}  // namespace memoryos::json
