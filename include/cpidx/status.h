// cpidx/status.h: the library's error type. C++ entry points return a Status (never throw,
// never exit); the Python layer turns a bad one into an exception carrying the message.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace cpidx {

enum class StatusCode {
  kSuccess = 0,
  kInvalidArgument,     // a host-visible argument is wrong (dtype, shape, stride, value)
  kUnsupported,         // a value outside the compiled set (head dim, K, dtype)
  kWorkspaceTooSmall,   // caller-provided memory is smaller than required
  kCudaError,           // a CUDA runtime call or launch failed
  kCommError,           // a collective failed or the ranks disagree
  kInternal,
};

const char* to_string(StatusCode code);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == StatusCode::kSuccess; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid argument: seq_lens must be int32 ..." style text for logs and exceptions.
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kSuccess;
  std::string message_;
};

inline Status invalid_argument(std::string msg) {
  return Status(StatusCode::kInvalidArgument, std::move(msg));
}
inline Status unsupported(std::string msg) {
  return Status(StatusCode::kUnsupported, std::move(msg));
}

namespace detail {

// Error-message text built by appending. Not an ostringstream: numbers are written with
// std::to_chars, so no locale or iostream facet is touched. (A Python extension built with the
// GPU machine's toolchain crashed inside ostream's integer insertion while formatting an error.)
class Message {
 public:
  Message& operator<<(std::string_view s) { text_.append(s); return *this; }
  Message& operator<<(const std::string& s) { text_.append(s); return *this; }
  Message& operator<<(const char* s) { text_.append(s ? s : "(null)"); return *this; }
  Message& operator<<(char c) { text_.push_back(c); return *this; }
  Message& operator<<(bool b) { text_.append(b ? "true" : "false"); return *this; }
  template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                             !std::is_same_v<T, char>,
                                         int> = 0>
  Message& operator<<(T v) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);
    text_.append(buf, r.ptr);
    return *this;
  }
  template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
  Message& operator<<(T v) {
    char buf[40];
    const auto r = std::to_chars(buf, buf + sizeof(buf), static_cast<double>(v));
    text_.append(buf, r.ptr);
    return *this;
  }
  template <typename T, std::enable_if_t<std::is_enum_v<T>, int> = 0>
  Message& operator<<(T v) {
    return *this << static_cast<std::underlying_type_t<T>>(v);
  }
  Message& operator<<(const void* p) {
    char buf[24];
    const auto r = std::to_chars(buf, buf + sizeof(buf), reinterpret_cast<uintptr_t>(p), 16);
    text_.append("0x").append(buf, r.ptr);
    return *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace detail
}  // namespace cpidx

// Return the Status of `expr` from the enclosing function if it is not ok.
#define CPIDX_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::cpidx::Status cpidx_status_ = (expr);      \
    if (!cpidx_status_.is_ok()) return cpidx_status_; \
  } while (0)

// Check a host precondition; on failure return kInvalidArgument with a streamed message.
// Usage: CPIDX_CHECK(k >= 1, "topk must be >= 1, got " << k);
#define CPIDX_CHECK(cond, msg_stream)                                    \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ::cpidx::detail::Message cpidx_msg_;                               \
      cpidx_msg_ << msg_stream;                                          \
      return ::cpidx::invalid_argument(cpidx_msg_.str());                \
    }                                                                    \
  } while (0)
