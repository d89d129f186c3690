#!/usr/bin/env bash
# Builds (once per machine) the venv in which CI runs the connector and tier tests against
# vLLM 0.34 (the main venv has vLLM 0.33): vLLM 0.34.0 with its requirements, and kvstore's.
# Prints the venv's python on its last line; everything else goes to stderr.
#
#   PY=$(scripts/vllm034_venv.sh | tail -n1)
#   PYTHONPATH=$PWD "$PY" -m pytest tests/connector
#
# Location: $KVTEST_VLLM034_VENV, else ~/.cache/kvstore-vllm034/venv-<hash of
# tests/connector/requirements-vllm034.txt and this script>, so a fresh clone on the same
# machine reuses it and a changed pin builds anew. Built only once its stamp file exists
# (written last); a half-built one is removed and rebuilt; concurrent callers wait on a lock.
#
# Why not 'pip install vllm==0.34.0': it fails, vLLM 0.34.0 pins flashinfer-python==0.7.3,
# which the registry does not serve. vLLM goes in with --no-deps, then its requirements with
# that one pin replaced (the requirements file says which). The tests put the repository under
# test first on PYTHONPATH, so the editable kvstore install made here never shadows a newer
# clone.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
req="$repo/tests/connector/requirements-vllm034.txt"
vllm_pin="vllm==0.34.0"
hash="$(cat "$req" "$repo/scripts/vllm034_venv.sh" | sha256sum | cut -c1-12)"
venv="${KVTEST_VLLM034_VENV:-$HOME/.cache/kvstore-vllm034/venv-$hash}"
stamp="$venv/.kvstore-vllm034-built"

log() { echo "vllm034_venv: $*" >&2; }

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ] && [ -x "$venv/bin/python" ]; then
  log "reusing $venv"
  echo "$venv/bin/python"
  exit 0
fi
if [ -e "$venv" ]; then
  log "removing incomplete venv $venv"
  rm -rf "$venv"
fi
cleanup() { if [ ! -f "$stamp" ]; then rm -rf "$venv"; fi; }
trap cleanup EXIT

log "building $venv (several minutes: ~9.6 GB)"
start=$(date +%s)
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip "setuptools>=68" wheel >&2
"${pip[@]}" install -q --no-deps "$vllm_pin" >&2
"${pip[@]}" install -q -r "$req" >&2
# kvstore with its test tools; vLLM's torch pin keeps its build in place.
# KVSTORE_BUILD_NATIVE=0 (.ci/run builds this venv while tests run): kvstore's optional
# extensions are not compiled here (CC=false: setuptools skips optional extensions that fail to
# build), so no in-place .so is rewritten under running tests; the checkout's build from the
# main venv (the same Python) serves.
repo_env=()
if [ "${KVSTORE_BUILD_NATIVE:-1}" = 0 ]; then
  repo_env=(CC=false)
fi
env "${repo_env[@]}" "${pip[@]}" install -q -e "$repo[dev]" "$(grep -E '^torch==' "$req")" >&2

"$venv/bin/python" - >&2 <<'PY'
import torch, vllm
from vllm.v1.kv_offload.base import DevicePointers  # the 0.34 offloading API
import kvstore, connector
assert vllm.__version__.startswith("0.34."), vllm.__version__
print("vllm034 venv ok: vllm", vllm.__version__, "torch", torch.__version__)
PY
echo "$hash" >"$stamp"
log "built in $(( $(date +%s) - start )) s"
echo "$venv/bin/python"
