#!/usr/bin/env bash
# GPU check of the device engines (docs/engines.md), in one run well inside 10 minutes:
#
#   1. environment: nvidia-smi, python/torch/CUDA, kvikio and its compat mode, GDS driver;
#   2. installs what the machine lacks from carried wheels in ./.wheels (no network there),
#      and says what is still missing (the run goes on with the engines it can use);
#   3. the `gpu`-marked tests: the engine conformance suite on real CUDA/kvikio, wsum64 on the
#      device, and the integrations' device paths without an engine (tests/test_device_paths.py:
#      vLLM 0.34's DevicePointers through the worker's resolver into RankIO on CUDA caches at
#      TP=2 -> TP=4/TP=1, SGLang's PoolStore on a pinned host pool; byte-exact against the host
#      engine);
#   4. the engines benchmark (kvstore.bench.engines): write and cold-read GB/s of the host,
#      pinned and gds engines vs raw O_DIRECT file I/O and vs torch D2H + os.pwrite, with the
#      0.8x-of-raw targets, at 2 MiB blocks, then a sweep of block sizes (256 KiB - 8 MiB),
#      batch sizes and threads (SWEEP); plus fio for reference when fio is installed;
#   5. where SGLang is installed, a real SGLang server with kvstore as HiCache storage, across a
#      restart (scripts/sglang_gpu_check.py).
#
# Logs go to $OUT (when set) or ./gpu-check-out. Every step has its own timeout; a failing
# step is reported and the next one still runs. Exit status: 0 when the gpu tests passed.
#
# Environment: PYTHON (default python3, or ./.venv/bin/python when python3 has no torch),
# GIB (data per system, default 2), THREADS (8), SWEEP (KIB:BATCH:THREADS cases; SWEEP_GIB
# data per system and case, default 0.5; SWEEP= skips it), SCRATCH (benchmark directory, default
# ./bench-scratch: put it on the filesystem to test), INSTALL=0 to install nothing (a dry run
# on a development machine).
#
# Install: every wheel in ./.wheels with `pip install --no-index --no-deps` (offline; letting
# pip resolve kvikio's dependencies would fail on cupy-cuda13x[ctk] extras it cannot fetch),
# then this project editable with --no-deps (pyproject asks torch>=2.13; the GPU machine's
# torch 2.11 is kept, and the device paths use nothing newer). Without setuptools there the
# editable install fails and PYTHONPATH does the job.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT_DIR="${OUT:-./gpu-check-out}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
if [ -z "${PYTHON:-}" ] && ! "$PY" -c 'import torch' >/dev/null 2>&1 && [ -x .venv/bin/python ]; then
    PY=.venv/bin/python  # a development machine: python3 without torch, the project's venv
fi
GIB="${GIB:-2}"
THREADS="${THREADS:-8}"
SWEEP="${SWEEP-256:32:8,1024:32:8,8192:32:8,2048:8:8,2048:128:8,2048:32:2,2048:32:16}"
SWEEP_GIB="${SWEEP_GIB:-0.5}"
SCRATCH="${SCRATCH:-./bench-scratch}"
INSTALL="${INSTALL:-1}"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

step() {  # step NAME SECONDS COMMAND... : run with a timeout, log, record the outcome
    local name="$1" limit="$2"
    shift 2
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    note "step $name: rc=$rc ($((SECONDS - started)) s, log $name.log)"
    tail -n 25 "$OUT_DIR/$name.log"
    return $rc
}

note "== gpu_check $(date -u +%FT%TZ) on $(hostname)"

# 1. environment ------------------------------------------------------------------------------
step nvidia-smi 30 nvidia-smi
step gds-tools 30 bash -c 'ls /usr/local/cuda*/gds/tools/gdscheck* 2>/dev/null && /usr/local/cuda/gds/tools/gdscheck -p || echo "gdscheck not found"'
mount | grep -E " $(df --output=target "$PWD" | tail -1) " | tee -a "$SUMMARY"

# 2. what is missing, installed from carried wheels ------------------------------------------
cat >"$OUT_DIR/missing.py" <<'EOF'
import importlib
need = ["torch", "numpy", "xxhash", "crc32c", "zarr", "numcodecs", "pytest",
        "cupy", "cuda.pathfinder", "libkvikio", "rapids_logger", "kvikio"]
missing = []
for name in need:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - kvikio's loader raises RuntimeError, not ImportError
        missing.append(name)
        print(f"missing: {name} ({type(exc).__name__}: {exc})")
print("MISSING=" + " ".join(missing))
EOF
note "python: $PY"
step missing 60 "$PY" "$OUT_DIR/missing.py"
MISSING="$(grep -o 'MISSING=.*' "$OUT_DIR/missing.log" | cut -d= -f2-)"
if [ -n "$MISSING" ] && [ "$INSTALL" = 1 ]; then
    if compgen -G ".wheels/*.whl" >/dev/null; then
        # Offline and without dependency resolution: the carried set is complete by design.
        step install 120 "$PY" -m pip install --no-index --no-deps .wheels/*.whl
        step missing-after 60 "$PY" "$OUT_DIR/missing.py"
    else
        note "no wheels in ./.wheels: cannot install ($MISSING); continuing without"
    fi
fi
if [ "$INSTALL" = 1 ]; then
    step install-self 90 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e . \
        || note "editable install failed; using PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step versions 60 "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import kvikio
    import kvikio.defaults  # not imported by `import kvikio`
    from kvstore.io.cufile import kvikio_compat_mode
    print("kvikio", getattr(kvikio, "__version__", "?"), "compat mode", kvikio_compat_mode(kvikio))
    for key in ("compat_mode", "num_threads", "gds_threshold", "task_size", "bounce_buffer_size"):
        print("kvikio.defaults", key, kvikio.defaults.get(key))
    print("kvikio.defaults is_compat_mode_preferred", kvikio.defaults.is_compat_mode_preferred())
    try:
        import kvikio.cufile_driver as drv
        for key in ("is_gds_available", "major_version", "minor_version", "allow_compat_mode"):
            try:
                print("cufile_driver", key, drv.get(key))
            except Exception as exc:  # noqa: BLE001
                print("cufile_driver", key, "?", exc)
    except Exception as exc:  # noqa: BLE001
        print("kvikio.cufile_driver unavailable:", exc)
except Exception as exc:  # noqa: BLE001
    print("kvikio not importable:", exc, "- the gds engine will be skipped")
from kvstore.config import StoreConfig
from kvstore.io.select import select_engine
import logging, tempfile
logging.basicConfig(level=logging.INFO)
with tempfile.TemporaryDirectory(dir=".") as d:
    sel = select_engine(StoreConfig(root=d, durability="none"))
    print("auto selection:", sel.line)
    sel.engine.close()
EOF

# 3. gpu tests -------------------------------------------------------------------------------
step gpu-tests 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs \
    tests/io/test_engine_conformance.py tests/test_checksum_wsum64.py tests/test_device_paths.py
TESTS_RC=$?

# 4. benchmark -------------------------------------------------------------------------------
mkdir -p "$SCRATCH"
DEVICE="$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null)"
if [ "$DEVICE" != cuda ]; then
    DEVICE=cpu
    GIB="${GIB_CPU:-0.0625}"  # a dry run: the CPU stand-ins' logic, not their speed
    SWEEP_GIB="${GIB_CPU:-0.0625}"
    note "no CUDA: the benchmark runs the CPU stand-ins on $GIB GiB"
fi
step bench-engines 120 "$PY" -m kvstore.bench.engines --device "$DEVICE" --gib "$GIB" \
    --threads "$THREADS" --root "$SCRATCH/engines" --json "$OUT_DIR/bench_engines.json"
rm -rf "$SCRATCH/engines"
if [ -n "$SWEEP" ]; then
    step bench-sweep 150 "$PY" -m kvstore.bench.engines --device "$DEVICE" --gib "$SWEEP_GIB" \
        --cases "$SWEEP" --root "$SCRATCH/sweep" --json "$OUT_DIR/bench_sweep.json"
    rm -rf "$SCRATCH/sweep"
fi
if command -v fio >/dev/null 2>&1; then
    for rw in write read; do
        step "fio-$rw" 60 fio --name="kv$rw" --directory="$SCRATCH" --rw="$rw" --bs=2M \
            --size=256M --numjobs="$THREADS" --direct=1 --ioengine=psync --group_reporting \
            --end_fsync=0
    done
    rm -f "$SCRATCH"/kv*
else
    note "fio not installed: the raw O_DIRECT baseline of bench_engines is the floor"
fi
rmdir "$SCRATCH" 2>/dev/null || true

# 5. SGLang with kvstore as its HiCache L3 storage (docs/sglang.md): a tiny random-weight model
# served, restarted on the same store, the same request. Only where SGLang's full install is
# present (its GPU kernels cannot come from the carried wheels).
if "$PY" -c 'import sglang.srt.entrypoints.http_server' >/dev/null 2>&1; then
    step sglang-serve 420 "$PY" scripts/sglang_gpu_check.py --workdir "$OUT_DIR/sglang" \
        --write-tp 1 --read-tp 1
else
    note "SGLang not installed: the SGLang server check (scripts/sglang_gpu_check.py) did not run"
fi

note "== done: gpu tests rc=$TESTS_RC"
cat "$SUMMARY"
exit "$TESTS_RC"
