#!/usr/bin/env bash
# scripts/ptx_diff.sh BUILD_DIR REV [SOURCE...]: whether the CUDA sources' device code changed
# since git revision REV, without a GPU. Each source (default: every src/**/*.cu) is compiled
# to PTX twice with the exact command BUILD_DIR's ninja uses for it (minus -lineinfo): in the
# working tree, and in a checkout of REV (its headers too). Line directives, file names and the
# anonymous namespaces' per-file hashes are normalized away, so a change to comments, host code
# or line numbers only reads "same"; anything else reads "DIFFERS" with the first differing lines.
# Exits 1 if any source differs. For reviews of GPU-validated code when no device time is left;
# it says nothing about host code (run the tests for that).
# Example: scripts/ptx_diff.sh build-peer HEAD~1 src/cuda/score_topk.cu
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD_DIR REV [SOURCE...]" >&2
  exit 2
fi
build=$(cd "$1" && pwd) || exit 2
rev=$2
shift 2
root=$(git rev-parse --show-toplevel) || exit 2
cd "$root" || exit 2
sources=("$@")
[ ${#sources[@]} -eq 0 ] && mapfile -t sources < <(git ls-files 'src/*.cu')
work=$(mktemp -d)

git worktree add --quiet --detach "$work/old" "$rev" || exit 2
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1; rm -rf "$work"' EXIT

# The ninja command that compiles `src` (a path relative to the root), run on the tree at `tree`,
# PTX to `out`, then normalized to `out`.norm.
ptx_of() {
  local src=$1 tree=$2 out=$3 obj cmd
  obj=$(cd "$build" && ninja -t targets all 2>/dev/null | sed -n "s|^\(.*/${src}\.o\): .*|\1|p" | head -n1)
  [ -n "$obj" ] || { echo "no ninja target compiles $src in $build" >&2; return 2; }
  cmd=$(cd "$build" && ninja -t commands "$obj" | tail -n1)
  cmd=${cmd//"$root/src"/"$tree/src"}
  cmd=${cmd//"$root/include"/"$tree/include"}
  cmd=${cmd//-lineinfo/}
  cmd=$(printf '%s' "$cmd" | sed -E 's/--generate-code=arch=compute_([0-9a-z]+),code=\[[^]]*\]/-arch=sm_\1/g; s/ -c / -ptx /; s/ -o [^ ]+/ -o '"${out//\//\\/}"'/; s/ -MD -MT [^ ]+ -MF [^ ]+//')
  (cd "$build" && eval "$cmd") >"$out.log" 2>&1 || { cat "$out.log" >&2; return 2; }
  grep -v -E '^[[:space:]]*(\.loc|\.file|//)' "$out" |
    sed -E 's/[0-9]+_GLOBAL__N__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/ANON/g;
            s/_INTERNAL_[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+/INTERNAL/g' >"$out.norm"
}

rc=0
for src in "${sources[@]}"; do
  src=${src#./}
  name=$(basename "$src" .cu)
  if ! git cat-file -e "$rev:$src" 2>/dev/null; then
    echo "new    $src (not in $rev)"
    continue
  fi
  ptx_of "$src" "$root" "$work/$name.new.ptx"; r1=$?
  ptx_of "$src" "$work/old" "$work/$name.old.ptx"; r2=$?
  if [ $r1 -ne 0 ] || [ $r2 -ne 0 ]; then rc=1; echo "FAILED $src (compile)"; continue; fi
  if cmp -s "$work/$name.new.ptx.norm" "$work/$name.old.ptx.norm"; then
    echo "same   $src"
  else
    echo "DIFFERS $src"
    diff "$work/$name.old.ptx.norm" "$work/$name.new.ptx.norm" | head -n 12
    rc=1
  fi
done
exit $rc
