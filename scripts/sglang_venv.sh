#!/usr/bin/env bash
# Builds (once per machine) the venv of the SGLang HiCache tier (tests/sglang): SGLang 0.5.23
# installed with --no-deps, the few packages its storage layer imports, and kvstore. Its tests
# drive SGLang's real storage-layer objects on CPU (HiCacheStorage backends, MHA/MLA device and
# host pools, HiCacheController over a gloo group); no model runs and no GPU is touched.
# Prints the venv's python on its last line; everything else goes to stderr.
#
#   PY=$(scripts/sglang_venv.sh | tail -n1)
#   PYTHONPATH=$PWD "$PY" -m pytest tests/sglang
#   scripts/sglang_venv.sh --if-built   # its python if it is built, else exit 3, building nothing
#
# Location: $KVTEST_SGLANG_VENV, else ~/.cache/kvstore-sglang/venv-<hash of
# tests/sglang/requirements-sglang.txt and this script>, so a fresh clone on the same machine
# reuses it and a changed pin builds anew. Built only once its stamp file exists (written
# last); a half-built one is removed and rebuilt; concurrent callers wait on a lock.
#
# Why --no-deps: sglang 0.5.23's own requirements pull flashinfer, deep-gemm, cutlass-dsl,
# sglang-kernel, the servers and tokenizers of every model family (~11 GB); the storage layer
# needs none of them. requirements-sglang.txt lists what its imports reach and says why torch
# is SGLang's CUDA build (2.14.1) and not the CPU 2.13: sglang.srt.configs imports torchvision,
# which has no CPU wheel here. Every install repeats the torch pins so nothing swaps the build.
# SGLang's page-hash extension (mem_cache/cpp_utils) compiles on first use with g++, ninja and
# OpenSSL's headers (libssl-dev), which the base image has.
# The tests put the repository under test first on PYTHONPATH, so the editable kvstore install
# made here (pointing at the clone that built the venv) never shadows a newer clone.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
req="$repo/tests/sglang/requirements-sglang.txt"
sglang_pin="sglang==0.5.23"
hash="$(cat "$req" "$repo/scripts/sglang_venv.sh" | sha256sum | cut -c1-12)"
venv="${KVTEST_SGLANG_VENV:-$HOME/.cache/kvstore-sglang/venv-$hash}"
stamp="$venv/.kvstore-sglang-built"
base_python="${KVTEST_SGLANG_BASE_PYTHON:-python3}"

log() { echo "sglang_venv: $*" >&2; }

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] && [ -x "$venv/bin/python" ]; then
  log "reusing $venv"
  echo "$venv/bin/python"
  exit 0
fi
if [ "${1:-}" = "--if-built" ]; then
  log "not built: $venv (scripts/sglang_venv.sh builds it)"
  exit 3
fi
if [ -e "$venv" ]; then
  log "removing incomplete venv $venv"
  rm -rf "$venv"
fi
cleanup() { if [ ! -f "$stamp" ]; then rm -rf "$venv"; fi; }
trap cleanup EXIT

log "building $venv (about 1.5 minutes from a warm pip cache: ~6.1 GB, 4.4 GB of it torch and its CUDA libraries)"
start=$(date +%s)
"$base_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
mapfile -t torch_pins < <(grep -E '^(torch|torchvision)==' "$req")

"${pip[@]}" install -q --upgrade pip "setuptools>=68" wheel >&2
# torch first, alone: a failure here names the real problem (no torch wheel reachable).
"${pip[@]}" install -q "${torch_pins[@]}" >&2
"${pip[@]}" install -q --no-deps "$sglang_pin" >&2
"${pip[@]}" install -q -r "$req" >&2
# kvstore with its test tools; the torch pins keep the build in place.
# KVSTORE_BUILD_NATIVE=0 (.ci/run builds this venv while tests run): kvstore's optional
# extensions are not compiled here (CC=false: setuptools skips optional extensions that fail to
# build), so no in-place .so is rewritten under running tests; the checkout's build from the
# main venv (the same Python) serves.
repo_env=()
if [ "${KVSTORE_BUILD_NATIVE:-1}" = 0 ]; then
  repo_env=(CC=false)
fi
env "${repo_env[@]}" "${pip[@]}" install -q -e "$repo[test]" "${torch_pins[@]}" >&2

"$venv/bin/python" - >&2 <<'PY'
import warnings
warnings.simplefilter("ignore")  # SGLang warns at import that AWQ/GGUF need a GPU
import torch, sglang
import sglang.srt.mem_cache.hicache_storage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheFile
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
import sglang.srt.mem_cache.memory_pool_host  # 0.5.23: only the DSv4 host pools live here
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.managers.cache_controller import HiCacheController
import kvstore, connector
assert sglang.__version__ == "0.5.23", sglang.__version__
print("sglang venv ok: sglang", sglang.__version__, "torch", torch.__version__)
PY
echo "$hash" >"$stamp"
log "built in $(( $(date +%s) - start )) s"
echo "$venv/bin/python"
