// A minimal JSON reader for the test data (objects, arrays, numbers, strings, true/false/
// null). Recursive descent over the whole text; throws std::runtime_error on malformed input.
#pragma once

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace json_lite {

struct Value {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject } type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::vector<std::string> keys;  // object keys, parallel to `values`
  std::vector<Value> values;

  bool has(const std::string& key) const {
    for (const auto& k : keys) {
      if (k == key) return true;
    }
    return false;
  }
  const Value& operator[](const std::string& key) const {
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] == key) return values[i];
    }
    throw std::runtime_error("json: missing key " + key);
  }
  const Value& operator[](size_t i) const { return array.at(i); }
  size_t size() const { return type == Type::kArray ? array.size() : values.size(); }
  int as_int() const { return static_cast<int>(number); }
  std::vector<int32_t> ints() const {
    std::vector<int32_t> out;
    for (const auto& v : array) out.push_back(static_cast<int32_t>(v.number));
    return out;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}
  Value parse() {
    Value v = value();
    skip();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("json: " + what + " at offset " + std::to_string(i_));
  }
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(const char* w) {
    const std::string ws(w);
    if (s_.compare(i_, ws.size(), ws) == 0) {
      i_ += ws.size();
      return true;
    }
    return false;
  }
  std::string str() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\') {
        ++i_;
        if (i_ >= s_.size()) fail("bad escape");
        const char e = s_[i_];
        out += e == 'n' ? '\n' : e == 't' ? '\t' : e;  // \uXXXX is not needed by the data
      } else {
        out += s_[i_];
      }
      ++i_;
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  Value value() {
    skip();
    if (i_ >= s_.size()) fail("unexpected end");
    Value v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.type = Value::Type::kObject;
      if (eat('}')) return v;
      do {
        skip();
        std::string key = str();
        expect(':');
        v.keys.push_back(std::move(key));
        v.values.push_back(value());
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.type = Value::Type::kArray;
      if (eat(']')) return v;
      do v.array.push_back(value());
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.type = Value::Type::kString;
      v.string = str();
    } else if (word("true")) {
      v.type = Value::Type::kBool;
      v.boolean = true;
    } else if (word("false")) {
      v.type = Value::Type::kBool;
    } else if (word("null")) {
      v.type = Value::Type::kNull;
    } else {
      char* end = nullptr;
      v.type = Value::Type::kNumber;
      v.number = std::strtod(s_.c_str() + i_, &end);
      if (end == s_.c_str() + i_) fail("bad value");
      i_ = static_cast<size_t>(end - s_.c_str());
    }
    return v;
  }
  const std::string& s_;
  size_t i_ = 0;
};

inline Value parse_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("json: cannot open " + path);
  std::stringstream buffer;
  buffer << file.rdbuf();
  const std::string text = buffer.str();
  return Parser(text).parse();
}

}  // namespace json_lite
