#!/usr/bin/env bash
# A prefix computed on one node, served on another: TTFT on a remote hit, a local hit and a
# recompute per prompt length, with the fetch's own time and rate, in one sitting
# (benches/python/cluster_cache.py says how).
#
#   scripts/bench-cluster-cache.sh [ROUNDS] [LENGTHS] [LAYERS]     (defaults 5, 512,1024,2000 and 8)
#
# KVD_CLUSTER_FIGURES=path also writes the figures as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
lengths=${2:-512,1024,2000}
layers=${3:-8}
target=$(realpath "${CARGO_TARGET_DIR:-target}")
echo "== building kvd and libkvd (release)"
cargo build --locked --release -p kvd -p kvd-ffi
venv=$(KVD_LIBKVD="$target/release/libkvd.so" scripts/engine-venv.sh)
command -v etcd >/dev/null || { echo "bench-cluster-cache: etcd is missing (apt-get install etcd-server; scripts/test.sh installs it)"; exit 1; }
echo "== remote hit, local hit, recompute ($rounds rounds per length, a $layers-layer model)"
KVD_BIN="$target/release/kvd" "$venv/bin/python" benches/python/cluster_cache.py --rounds "$rounds" \
    --lengths "$lengths" --layers "$layers" ${KVD_CLUSTER_FIGURES:+--out "$KVD_CLUSTER_FIGURES"}
