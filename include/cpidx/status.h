// cpidx/status.h: the library's error type. C++ entry points return a Status (never throw,
// never exit); the Python layer turns a bad one into an exception carrying the message.
#pragma once

#include <string>
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

}  // namespace cpidx

// Return the Status of `expr` from the enclosing function if it is not ok.
#define CPIDX_RETURN_IF_ERROR(expr)              \
  do {                                           \
    ::cpidx::Status cpidx_status_ = (expr);      \
    if (!cpidx_status_.is_ok()) return cpidx_status_; \
  } while (0)

// Check a host precondition; on failure return kInvalidArgument with a streamed message.
// Usage: CPIDX_CHECK(k >= 1, "topk must be >= 1, got " << k);
#include <sstream>
#define CPIDX_CHECK(cond, msg_stream)                                    \
  do {                                                                   \
    if (!(cond)) {                                                       \
      std::ostringstream cpidx_os_;                                      \
      cpidx_os_ << msg_stream;                                           \
      return ::cpidx::invalid_argument(cpidx_os_.str());                 \
    }                                                                    \
  } while (0)
