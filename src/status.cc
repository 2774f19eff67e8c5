// Status and StatusCode text: the "<code>: <message>" form used by logs, the CLI and the
// Python exceptions.
#include "cpidx/status.h"

namespace cpidx {

const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kSuccess:
      return "success";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kUnsupported:
      return "unsupported";
    case StatusCode::kWorkspaceTooSmall:
      return "workspace too small";
    case StatusCode::kCudaError:
      return "cuda error";
    case StatusCode::kCommError:
      return "communicator error";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown status";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  std::string text = cpidx::to_string(code_);
  if (!message_.empty()) text += ": " + message_;
  return text;
}

}  // namespace cpidx
