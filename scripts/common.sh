# scripts/common.sh: sourced by demo.sh and test.sh. Installs the Debian packages cpidx needs when
# they are missing (apt-get update only then), puts CUDA on PATH when it is installed, and
# configures + builds the `ci` preset (build-ci/). Safe to run again: it only does what is missing.

CPIDX_APT_PACKAGES=(cmake g++ make libgtest-dev libbenchmark-dev openmpi-bin libopenmpi-dev)
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

cpidx_ensure_packages() {
  if command -v dpkg-query >/dev/null 2>&1; then
    local missing=() p
    for p in "${CPIDX_APT_PACKAGES[@]}"; do
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' ||
        missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
      cpidx_log "installing missing packages: ${missing[*]}"
      cpidx_as_root apt-get update
      cpidx_as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y --no-install-recommends "${missing[@]}"
    fi
  else
    cpidx_log "no dpkg: not a Debian system, assuming ${CPIDX_APT_PACKAGES[*]} are installed"
  fi
  # The presets need CMake >= 3.25; older systems get it from pip.
  if ! cpidx_cmake_ok; then
    cpidx_log "installing cmake>=${CPIDX_MIN_CMAKE} with pip"
    python3 -m pip install --user "cmake>=${CPIDX_MIN_CMAKE}"
    export PATH="$HOME/.local/bin:$PATH"
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
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  cpidx_ensure_packages
  cpidx_cuda_path
  cpidx_build_ci
}
