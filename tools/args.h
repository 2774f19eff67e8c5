// tools/args.h: the tiny flag parser of the `cpidx` subcommands. Accepts --name=value and
// --name value (integers take K/M/G suffixes, like nccl-tests' sizes), comma lists of integers
// or words, switches as --name or --name=true|false, and prints a --help text listing every
// flag with its meaning and default.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace cpidx::tools {

class Flags {
 public:
  enum class Parse { kOk, kHelp, kError };

  // `usage` is the synopsis line ("cpidx demo [flags]"), `summary` a paragraph under it.
  Flags(std::string usage, std::string summary)
      : usage_(std::move(usage)), summary_(std::move(summary)) {}

  Flags& add(const char* name, int64_t* value, const char* help) {
    return add_flag(name, value, help, std::to_string(*value), "N");
  }
  // An integer in [lo, hi].
  Flags& add(const char* name, int64_t* value, const char* help, int64_t lo, int64_t hi) {
    add(name, value, help);
    flags_.back().lo = lo;
    flags_.back().hi = hi;
    return *this;
  }
  Flags& add(const char* name, double* value, const char* help) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", *value);
    return add_flag(name, value, help, text, "X");
  }
  Flags& add(const char* name, bool* value, const char* help) {
    return add_flag(name, value, help, *value ? "true" : "false", "");
  }
  // A comma list of integers in [lo, hi] (each with an optional K/M/G suffix), e.g.
  // --contexts=8K,1M.
  Flags& add(const char* name, std::vector<int64_t>* value, const char* help, int64_t lo,
             int64_t hi) {
    std::string text;
    for (int64_t v : *value) {
      if (!text.empty()) text += ',';
      text += size_text(v);
    }
    add_flag(name, value, help, text, "N,N,...");
    flags_.back().lo = lo;
    flags_.back().hi = hi;
    return *this;
  }
  // A comma list of words, e.g. --modes=plain1,cp2.
  Flags& add(const char* name, std::vector<std::string>* value, const char* help) {
    std::string text;
    for (const std::string& v : *value) {
      if (!text.empty()) text += ',';
      text += v;
    }
    return add_flag(name, value, help, text, "S,S,...");
  }
  // A string flag; when `choices` is not empty the value must be one of them.
  Flags& add(const char* name, std::string* value, const char* help,
             std::initializer_list<const char*> choices = {}) {
    std::string meta;
    for (const char* c : choices) {
      if (!meta.empty()) meta += '|';
      meta += c;
    }
    add_flag(name, value, help, *value, meta.empty() ? "S" : meta);
    flags_.back().choices.assign(choices.begin(), choices.end());
    return *this;
  }

  // Parses argv[first, argc). Prints the help to stdout (kHelp) or the error and a hint to
  // stderr (kError).
  Parse parse(int argc, char** argv, int first) {
    for (int i = first; i < argc; ++i) {
      std::string_view arg = argv[i];
      if (arg == "--help" || arg == "-h") {
        print_help(stdout);
        return Parse::kHelp;
      }
      if (arg.substr(0, 2) != "--" || arg.size() == 2) {
        // `--steal false`: a boolean flag takes its value after '=' only.
        if (const Flag* prev = i > first ? bare_bool(argv[i - 1]) : nullptr;
            prev != nullptr && (arg == "true" || arg == "false" || arg == "0" || arg == "1")) {
          return fail("flag --" + prev->name + " takes its value after '=': --" + prev->name +
                      "=" + std::string(arg));
        }
        return fail("unexpected argument '" + std::string(arg) + "'");
      }
      arg.remove_prefix(2);
      std::string_view name = arg, text;
      bool has_text = false;
      if (size_t eq = arg.find('='); eq != std::string_view::npos) {
        name = arg.substr(0, eq);
        text = arg.substr(eq + 1);
        has_text = true;
      }
      Flag* flag = find(name);
      if (flag == nullptr) return fail("unknown flag --" + std::string(name));
      if (!has_text && !std::holds_alternative<bool*>(flag->target)) {
        if (i + 1 >= argc) return fail("flag --" + flag->name + " needs a value");
        text = argv[++i];
      }
      std::string error = assign(*flag, text, has_text);
      if (!error.empty()) return fail(error);
      flag->set = true;
    }
    return Parse::kOk;
  }

  // True when the flag was given on the command line (not just defaulted).
  bool is_set(std::string_view name) const {
    for (const Flag& f : flags_) {
      if (f.name == name) return f.set;
    }
    return false;
  }

  void print_help(std::FILE* out) const {
    std::fprintf(out, "usage: %s\n\n%s\n\nflags:\n", usage_.c_str(), summary_.c_str());
    size_t width = 6;  // "--help"
    std::vector<std::string> heads;
    for (const Flag& f : flags_) {
      heads.push_back("--" + f.name + (f.meta.empty() ? "" : "=" + f.meta));
      width = std::max(width, heads.back().size());
    }
    for (size_t i = 0; i < flags_.size(); ++i) {
      std::fprintf(out, "  %-*s  %s (default: %s)\n", static_cast<int>(width), heads[i].c_str(),
                   flags_[i].help.c_str(), flags_[i].default_text.c_str());
    }
    std::fprintf(out, "  %-*s  print this help and exit\n", static_cast<int>(width), "--help");
  }

 private:
  using Target = std::variant<int64_t*, double*, bool*, std::string*, std::vector<int64_t>*,
                              std::vector<std::string>*>;
  struct Flag {
    std::string name, help, default_text, meta;
    Target target;
    std::vector<std::string> choices;
    bool set = false;
    int64_t lo = INT64_MIN, hi = INT64_MAX;  // integers: the range (of each item of a list)
  };

  template <typename T>
  Flags& add_flag(const char* name, T* value, const char* help, std::string default_text,
                  std::string meta) {
    flags_.push_back(Flag{name, help, std::move(default_text), std::move(meta), value, {}});
    return *this;
  }

  Flag* find(std::string_view name) {
    for (Flag& f : flags_) {
      if (f.name == name) return &f;
    }
    return nullptr;
  }

  // The boolean flag `arg` names when given without '=' ("--steal"), else null.
  const Flag* bare_bool(std::string_view arg) {
    if (arg.substr(0, 2) != "--" || arg.find('=') != std::string_view::npos) return nullptr;
    const Flag* flag = find(arg.substr(2));
    return flag != nullptr && std::holds_alternative<bool*>(flag->target) ? flag : nullptr;
  }

  Parse fail(const std::string& message) const {
    std::fprintf(stderr, "%s: %s (see --help)\n", usage_.substr(0, usage_.find(" [")).c_str(),
                 message.c_str());
    return Parse::kError;
  }

  // 8192 -> "8K", 1048576 -> "1M", 3 -> "3".
  static std::string size_text(int64_t v) {
    if (v != 0 && v % (int64_t{1} << 20) == 0) return std::to_string(v >> 20) + "M";
    if (v != 0 && v % 1024 == 0) return std::to_string(v >> 10) + "K";
    return std::to_string(v);
  }

  // An integer with an optional K/M/G suffix; empty on success, else why not.
  static std::string parse_int(std::string_view text, int64_t* out) {
    int64_t v = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || end == text.data()) return "expected an integer";
    std::string_view suffix(end, static_cast<size_t>(text.data() + text.size() - end));
    int shift = suffix == "" ? 0 : suffix == "K" || suffix == "k" ? 10
              : suffix == "M" ? 20 : suffix == "G" ? 30 : -1;
    if (shift < 0) return "expected an integer, optionally with K, M or G";
    if (v > (INT64_MAX >> shift) || v < (INT64_MIN >> shift)) return "out of range";
    *out = v * (int64_t{1} << shift);
    return {};
  }

  // "a,b,c" -> {"a", "b", "c"}; false if an item is empty.
  static bool split_list(std::string_view text, std::vector<std::string_view>* items) {
    items->clear();
    size_t i = 0;
    while (true) {
      const size_t j = std::min(text.find(',', i), text.size());
      if (j == i) return false;
      items->push_back(text.substr(i, j - i));
      if (j == text.size()) return true;
      i = j + 1;
    }
  }

  // Empty on success, else the error message.
  static std::string assign(Flag& flag, std::string_view text, bool has_text) {
    const std::string bad = "bad value '" + std::string(text) + "' for --" + flag.name;
    if (auto* p = std::get_if<int64_t*>(&flag.target)) {
      int64_t v = 0;
      std::string why = parse_int(text, &v);
      if (why.empty() && (v < flag.lo || v > flag.hi)) {
        why = "expected " + size_text(flag.lo) + ".." + size_text(flag.hi);
      }
      if (!why.empty()) return bad + " (" + why + ")";
      **p = v;
    } else if (auto* p = std::get_if<std::vector<int64_t>*>(&flag.target)) {
      std::vector<std::string_view> items;
      if (!split_list(text, &items)) return bad + " (expected a comma list, no empty items)";
      std::vector<int64_t> values(items.size());
      for (size_t i = 0; i < items.size(); ++i) {
        std::string why = parse_int(items[i], &values[i]);
        if (why.empty() && (values[i] < flag.lo || values[i] > flag.hi)) {
          why = "expected " + size_text(flag.lo) + ".." + size_text(flag.hi);
        }
        if (!why.empty()) return bad + " (item '" + std::string(items[i]) + "': " + why + ")";
      }
      **p = std::move(values);
    } else if (auto* p = std::get_if<std::vector<std::string>*>(&flag.target)) {
      std::vector<std::string_view> items;
      if (!split_list(text, &items)) return bad + " (expected a comma list, no empty items)";
      (*p)->assign(items.begin(), items.end());
    } else if (auto* p = std::get_if<double*>(&flag.target)) {
      std::string s(text);
      char* end = nullptr;
      double v = std::strtod(s.c_str(), &end);
      if (s.empty() || *end != '\0') return bad + " (expected a number)";
      **p = v;
    } else if (auto* p = std::get_if<bool*>(&flag.target)) {
      if (!has_text || text == "true" || text == "1") {
        **p = true;
      } else if (text == "false" || text == "0") {
        **p = false;
      } else {
        return bad + " (expected true or false)";
      }
    } else if (auto* p = std::get_if<std::string*>(&flag.target)) {
      if (!flag.choices.empty()) {
        bool ok = false;
        for (const std::string& c : flag.choices) ok = ok || c == text;
        if (!ok) return bad + " (expected " + flag.meta + ")";
      }
      **p = std::string(text);
    }
    return {};
  }

  std::string usage_, summary_;
  std::vector<Flag> flags_;
};

}  // namespace cpidx::tools
