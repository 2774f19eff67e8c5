// cpidx/version.h: the library's version, the one place it is written. CMake's project() reads it
// from here (so the installed package's cpidxConfigVersion.cmake says the same), and the Python
// module reports it as cpidx.__version__ (a test checks pyproject.toml against it).
#pragma once

#define CPIDX_VERSION_MAJOR 0
#define CPIDX_VERSION_MINOR 1
#define CPIDX_VERSION_PATCH 0
#define CPIDX_VERSION "0.1.0"
