#!/usr/bin/env bash
# Downloads, into ./.wheels (git-ignored), the Python wheels the device machine lacks for
# scripts/gpu_check.sh: its image has Python 3.12, torch, cupy-cuda13x, cuda-toolkit and
# nvidia-cufile but no network, no kvikio and not the zarr stack kvstore pins. Run it here (it
# needs PyPI), then on the device:  run(command="bash scripts/gpu_check.sh", carry=[".wheels"])
# About 14 MB. PYVER overrides the device's Python version (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${PYVER:-3.12}"
rm -rf .wheels
mkdir -p .wheels
# --no-deps: these exact wheels; the device already has their other dependencies (numpy,
# packaging, typing-extensions, cupy-cuda13x[ctk], cuda-pathfinder, cuda-toolkit[cufile]).
python3 -m pip download --quiet --only-binary=:all: --no-deps --implementation cp \
  --python-version "$PYVER" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
  -d .wheels \
  "kvikio-cu13==26.10.0" "libkvikio-cu13==26.10.0" "rapids-logger==0.3.*" \
  "zarr==3.1.6" "numcodecs==0.16.6" "crc32c==2.9.post0" "donfig==0.8.1.post1" \
  "google-crc32c==1.9.0"
ls -1 .wheels
du -sh .wheels
