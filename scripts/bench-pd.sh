#!/usr/bin/env bash
# Prefill/decode through kvd beside colocated vLLM and beside vLLM's NixlConnector: TTFT, the
# hand-off and its rate against kvd-bench remote's for the same blocks per transfer, in one
# sitting (benches/python/pd_handoff.py says how). Installs nixl into the engine venv.
#
#   scripts/bench-pd.sh [ROUNDS] [LENGTHS] [NIXL_ROUNDS]     (defaults 20, 256,1024,2000 and 5)
#
# KVD_PD_FIGURES=path also writes the figures as JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-20}
lengths=${2:-256,1024,2000}
nixl_rounds=${3:-5}
target=$(realpath "${CARGO_TARGET_DIR:-target}")
echo "== building kvd, kvd-bench and libkvd (release)"
cargo build --locked --release -p kvd -p kvd-bench -p kvd-ffi
venv=$(KVD_LIBKVD="$target/release/libkvd.so" scripts/engine-venv.sh)
if ! "$venv/bin/python" -c "import nixl" 2>/dev/null; then
    echo "== installing nixl into the engine venv (its cu13 build; UCX runs over TCP here)"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps nixl nixl-cu13
fi
# the bound's rate: kvd-bench remote's fetch GB/s for 32 KiB blocks (the tiny model's block: 32 tokens
# of 1 KiB), as many per fetch as a hand-off of that prompt loads, one fetch in flight, by the
# fetching daemon's own timer (its last column): the span the hand-off's rate is measured over.
# Twice: isolated fetches, each after 1 s idle as a hand-off comes (each request starts after
# the last ended), which are the bound; and back to back (threads kept warm), reported beside.
remote="{" warm="{"
for len in ${lengths//,/ }; do
    blocks=$(( (len - 1) / 32 ))
    echo "== kvd-bench remote: 32 KiB blocks, $blocks per fetch (a $len-token prompt's hand-off), back to back"
    out=$("$target/release/kvd-bench" remote --kvd "$target/release/kvd" --block-kib 32 --batch "$blocks" \
        --in-flight 1 --gib-per-case 0.1 --repeat 3)
    echo "$out" | grep -E "^(block|32 KiB)"
    warm+="\"$len\": $(echo "$out" | awk '/^32 KiB/ {print $NF}'),"
    echo "== kvd-bench remote: the same, 12 isolated fetches per run, each after 1 s idle"
    gib=$(awk -v b="$blocks" 'BEGIN {printf "%.6f", 12 * b * 32 / 1048576}')
    out=$("$target/release/kvd-bench" remote --kvd "$target/release/kvd" --block-kib 32 --batch "$blocks" \
        --in-flight 1 --gib-per-case "$gib" --repeat 2 --idle-ms 1000)
    echo "$out" | grep -E "^(block|32 KiB)"
    remote+="\"$len\": $(echo "$out" | awk '/^32 KiB/ {print $NF}'),"
done
remote="${remote%,}}" warm="${warm%,}}"
command -v etcd >/dev/null || { echo "bench-pd: etcd is missing (apt-get install etcd-server; scripts/test.sh installs it)"; exit 1; }
echo "== P/D: colocated, kvd (vLLM's proxy contract and kvd control's front) and NIXL ($rounds rounds per length, NIXL $nixl_rounds)"
KVD_BIN="$target/release/kvd" "$venv/bin/python" benches/python/pd_handoff.py --rounds "$rounds" \
    --lengths "$lengths" --nixl-rounds "$nixl_rounds" --remote-gbps "$remote" --remote-warm-gbps "$warm" \
    ${KVD_PD_FIGURES:+--out "$KVD_PD_FIGURES"}
