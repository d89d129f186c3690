#!/usr/bin/env bash
# The GlusterFS test environment of the scale-out tests (tests/scaleout/gluster.py), for people:
#   scripts/gluster_env.sh [start]     install glusterfs if missing, start, print the mount points
#   scripts/gluster_env.sh status      is it running?
#   scripts/gluster_env.sh stop        unmount, stop the daemons, delete namespaces and state
#   scripts/gluster_env.sh delay USEC  add USEC microseconds to every brick LOOKUP/STAT (0: none)
# Needs root, /dev/fuse and network namespaces. State lives in $KVSTORE_GLUSTER_BASE
# (default /srv/kvstore-gluster); addresses 10.99.0.0/24 exist only inside the namespaces.
# While it runs, `pytest -m scaleout` reuses it instead of starting its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
action=${1:-start}

if [ "$action" = start ] && ! command -v glusterd >/dev/null; then
  echo "installing glusterfs-server glusterfs-client" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q glusterfs-server glusterfs-client
fi
exec "$PY" -m tests.scaleout.gluster "$@"
