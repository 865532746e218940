#!/usr/bin/env bash
# kvd under a real vLLM (CPU build): TTFT of a long prompt recomputed against loaded from kvd,
# and the connector's time per scheduler step (benches/python/vllm_connector.py says how).
#
#   scripts/bench-vllm.sh [ROUNDS] [PROMPT_TOKENS]     (defaults 3 and 1100)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
tokens=${2:-1100}
cargo build --locked -p kvd -p kvd-ffi
venv=$(scripts/engine-venv.sh)
out=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null || true; rm -rf "$out"' EXIT
target/debug/kvd serve --data-dir "$out/data" --socket "$out/kvd.sock" --admin-listen 127.0.0.1:0 \
    --pool-mib 256 --page-kib 64 --huge-pages off > "$out/ready" 2> "$out/daemon.log" &
daemon=$!
for _ in $(seq 1 600); do grep -q "^kvd ready" "$out/ready" 2>/dev/null && break; sleep 0.1; done
grep -q "^kvd ready" "$out/ready" || { cat "$out/daemon.log"; echo "kvd did not start"; exit 1; }
"$venv/bin/python" benches/python/vllm_connector.py "$out/kvd.sock" "$rounds" "$tokens"
