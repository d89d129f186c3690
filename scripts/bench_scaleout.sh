#!/usr/bin/env bash
# The scale-out benchmark (kvstore/bench/scaleout.py) on the GlusterFS test environment:
# throughput and lookups through the FUSE mounts vs the local disk under the bricks, then the
# lookups again with 400 us added to every brick LOOKUP/STAT (a network round trip to another
# machine, which veth pairs on one machine lack). Writes docs/scaleout.md (or $1).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-docs/scaleout.md}
BASE=${KVSTORE_GLUSTER_BASE:-/srv/kvstore-gluster}
BLOCKS=${BLOCKS:-128}
scripts/gluster_env.sh start >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"; "$PY" -m tests.scaleout.gluster delay 0 >/dev/null || true' EXIT
"$PY" -m tests.scaleout.gluster delay 0 >/dev/null
mount_note=$("$PY" -c 'from tests.scaleout.gluster import MOUNT_OPTIONS as m; print("`" + " ".join(m) + "`")')
common=(--node-a "$BASE/mnt/node-a" --node-b "$BASE/mnt/node-b" --local "$BASE/local"
        --brick-dir "$BASE/s1/brick" --brick-dir "$BASE/s2/brick" --mount-note "$mount_note"
        --blocks "$BLOCKS")
"$PY" -m kvstore.bench.scaleout run "${common[@]}" --json "$work/plain.json"
"$PY" -m tests.scaleout.gluster delay 400 >/dev/null
"$PY" -m kvstore.bench.scaleout run "${common[@]}" --lookup-only \
  --label "With 400 us added to every brick LOOKUP/STAT (debug/delay-gen)" --json "$work/delay.json"
"$PY" -m kvstore.bench.scaleout render "$OUT" "$work/plain.json" "$work/delay.json"
echo "wrote $OUT"
