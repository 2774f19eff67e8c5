// cpidx/version.h: the library's version. CMake's project() reads it from here (so the installed
// package's cpidxConfigVersion.cmake says the same), and the Python module reports it as
// cpidx.__version__; pyproject.toml repeats it for pip (a test checks the two agree). Below 1.0
// each minor version may change the API (the package's COMPATIBILITY is SameMinorVersion).
// 0.2.0: Communicator gains the virtuals check_agree_all, max_bytes_per_rank and device (a
// subclass of your own must be rebuilt against these headers); every Decoder and Prefiller call
// refuses a current device other than the one it was created on, and cp_decode a communicator
// of another device; cp_decode agrees on its settings too.
#pragma once

#define CPIDX_VERSION_MAJOR 0
#define CPIDX_VERSION_MINOR 2
#define CPIDX_VERSION_PATCH 0
#define CPIDX_VERSION "0.2.0"
