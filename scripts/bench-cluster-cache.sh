#!/usr/bin/env bash
# A prefix computed on one node, served on another, in one sitting:
# 1. TTFT on a remote hit, a local hit and a recompute per prompt length, with the fetch's own
#    time and rate (benches/python/cluster_cache.py);
# 2. multi-turn conversations over three nodes through kvd control's front: hit rate, TTFT and
#    tokens computed with the local cache only, the cluster cache routed by load and the cluster
#    cache routed by cached prefix (benches/python/multiturn.py).
#
#   scripts/bench-cluster-cache.sh [ROUNDS] [LENGTHS] [LAYERS] [CONVERSATIONS] [TURNS]
#                                  (defaults 5, 512,1024,2000, 8, 32, 8; ROUNDS 0 skips part 1)
#
# KVD_CLUSTER_FIGURES=prefix also writes the figures as prefix-ttft.json and prefix-multiturn.json.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
lengths=${2:-512,1024,2000}
layers=${3:-8}
conversations=${4:-32}
turns=${5:-8}
target=$(realpath "${CARGO_TARGET_DIR:-target}")
echo "== building kvd and libkvd (release)"
cargo build --locked --release -p kvd -p kvd-ffi
venv=$(KVD_LIBKVD="$target/release/libkvd.so" scripts/engine-venv.sh)
command -v etcd >/dev/null || { echo "bench-cluster-cache: etcd is missing (apt-get install etcd-server; scripts/test.sh installs it)"; exit 1; }
if [ "$rounds" -gt 0 ]; then
    echo "== remote hit, local hit, recompute ($rounds rounds per length, a $layers-layer model)"
    KVD_BIN="$target/release/kvd" "$venv/bin/python" benches/python/cluster_cache.py --rounds "$rounds" \
        --lengths "$lengths" --layers "$layers" ${KVD_CLUSTER_FIGURES:+--out "$KVD_CLUSTER_FIGURES-ttft.json"}
fi
if [ "$conversations" -gt 0 ]; then
    echo "== $conversations conversations of $turns turns over three nodes, three set-ups"
    KVD_BIN="$target/release/kvd" "$venv/bin/python" benches/python/multiturn.py --conversations "$conversations" \
        --turns "$turns" --layers "$layers" ${KVD_CLUSTER_FIGURES:+--out "$KVD_CLUSTER_FIGURES-multiturn.json"}
fi
