// cpidx/version.h: the library's version. CMake's project() reads it from here (so the installed
// package's cpidxConfigVersion.cmake says the same), and the Python module reports it as
// cpidx.__version__; pyproject.toml repeats it for pip (a test checks the two agree).
#pragma once

#define CPIDX_VERSION_MAJOR 0
#define CPIDX_VERSION_MINOR 1
#define CPIDX_VERSION_PATCH 0
#define CPIDX_VERSION "0.1.0"
