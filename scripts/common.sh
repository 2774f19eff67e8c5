# shellcheck shell=bash
# scripts/common.sh: sourced by demo.sh and test.sh. Installs the Debian packages cpidx needs when
# they are missing (apt-get update only then), puts CUDA on PATH when it is installed, and
# configures + builds the `ci` preset (build-ci/). Safe to run again: it only does what is missing.

CPIDX_APT_PACKAGES=(cmake g++ make libgtest-dev openmpi-bin libopenmpi-dev)
CPIDX_MIN_CMAKE=3.25

cpidx_log() { printf '==> %s\n' "$*" >&2; }

# Run as root, or through sudo when there is one.
cpidx_as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else cpidx_log "need root to run: $*"; return 1
  fi
}

cpidx_cmake_ok() {
  command -v cmake >/dev/null 2>&1 || return 1
  local have
  have="$(cmake --version | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')"
  [ "$(printf '%s\n%s\n' "$CPIDX_MIN_CMAKE" "$have" | sort -V | head -n1)" = "$CPIDX_MIN_CMAKE" ]
}

# Installs, with apt-get, those of the given Debian packages that are not installed yet (runs
# `apt-get update` only when something is missing).
cpidx_apt_install_missing() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
      missing+=("$p")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    cpidx_log "installing missing packages: ${missing[*]}"
    cpidx_as_root apt-get update
    cpidx_as_root env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y --no-install-recommends "${missing[@]}"
  fi
}

cpidx_ensure_packages() {
  if command -v dpkg-query >/dev/null 2>&1; then
    cpidx_apt_install_missing "${CPIDX_APT_PACKAGES[@]}"
  else
    cpidx_log "no dpkg: not a Debian system, assuming ${CPIDX_APT_PACKAGES[*]} are installed"
  fi
  # The presets need CMake >= 3.25; older systems get it from pip, into a virtual environment of
  # the checkout's (a system Python that PEP 668 marks externally managed refuses --user).
  if ! cpidx_cmake_ok; then
    local venv
    venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build-ci/cmake-venv"
    export PATH="$venv/bin:$PATH"
    if ! cpidx_cmake_ok; then  # not there from an earlier run either
      cpidx_log "installing cmake>=${CPIDX_MIN_CMAKE} with pip into ${venv}"
      if command -v dpkg-query >/dev/null 2>&1; then cpidx_apt_install_missing python3-venv; fi
      python3 -m venv "$venv"
      "$venv/bin/python" -m pip install --disable-pip-version-check -q "cmake>=${CPIDX_MIN_CMAKE}"
    fi
  fi
}

# nvcc in /usr/local/cuda is found by the `ci` preset (CUDA kernels compile without a GPU).
cpidx_cuda_path() {
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    case ":$PATH:" in *:/usr/local/cuda/bin:*) ;; *) export PATH="/usr/local/cuda/bin:$PATH" ;; esac
  fi
}

cpidx_build_ci() {
  cpidx_log "configuring (cmake --preset ci)"
  cmake --preset ci
  cpidx_log "building (cmake --build --preset ci -j$(nproc))"
  cmake --build --preset ci -j"$(nproc)"
}

cpidx_prepare() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
  cpidx_ensure_packages
  cpidx_cuda_path
  cpidx_build_ci
}

# ---- Python package (scripts/test.sh) ----------------------------------------------------------
# A virtual environment in build-ci/pyenv (Debian's python3 needs python3-venv and python3-dev for
# it and for the module's headers), then `pip install .[test]` of the CPU-only wheel: CI has no
# GPU and the CUDA kernels were already compiled by the ctest build, so the wheel skips them
# (CPIDX_PY_CMAKE_ARGS overrides, e.g. CPIDX_PY_CMAKE_ARGS= for a CUDA wheel).
CPIDX_PY_APT_PACKAGES=(python3 python3-dev python3-venv python3-pip)

cpidx_ensure_python() {
  if command -v dpkg-query >/dev/null 2>&1 &&
     { ! command -v python3 >/dev/null 2>&1 || [ "$(command -v python3)" = /usr/bin/python3 ]; }; then
    cpidx_apt_install_missing "${CPIDX_PY_APT_PACKAGES[@]}"
  fi
}

cpidx_install_python() {
  cpidx_ensure_python
  local venv=build-ci/pyenv
  if [ ! -x "$venv/bin/python" ]; then
    cpidx_log "creating $venv (python3 -m venv)"
    python3 -m venv "$venv"
  fi
  cpidx_log "pip install .[test] (CMAKE_ARGS=${CPIDX_PY_CMAKE_ARGS-"-DCPIDX_CUDA=OFF"}; log in build-ci/pip.log)"
  if ! CMAKE_ARGS="${CPIDX_PY_CMAKE_ARGS-"-DCPIDX_CUDA=OFF"}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
       "$venv/bin/python" -m pip install --disable-pip-version-check ".[test]" \
       >build-ci/pip.log 2>&1; then
    tail -n 40 build-ci/pip.log
    cpidx_log "pip install failed (build-ci/pip.log)"
    return 1
  fi
  if [ "${CPIDX_TEST_TORCH:-0}" = 1 ]; then cpidx_install_torch "$venv"; fi
}

# CPIDX_TEST_TORCH=1: torch in the same venv, so that the torch tests run on the CPU too (the
# registered ops under opcheck and torch.compile, IndexerCPDecode over two gloo processes).
# PyPI's wheel carries its CUDA libraries (~5 GB installed), so this is opt-in (CI sets it) and
# best effort: a failed or slow install (10 min) leaves those tests skipping, with a note.
CPIDX_TORCH_SPEC="torch==2.11.*"  # the device machine's torch

cpidx_install_torch() {
  local venv=$1
  if "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then return 0; fi
  cpidx_log "pip install ${CPIDX_TORCH_SPEC} (CPIDX_TEST_TORCH=1; log in build-ci/pip-torch.log)"
  if ! timeout 600 "$venv/bin/python" -m pip install --disable-pip-version-check --no-cache-dir \
       "${CPIDX_TORCH_SPEC}" >build-ci/pip-torch.log 2>&1; then
    tail -n 5 build-ci/pip-torch.log
    cpidx_log "torch could not be installed: the torch tests will skip (build-ci/pip-torch.log)"
  fi
}
