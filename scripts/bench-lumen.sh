#!/usr/bin/env bash
# The LUMEN experiment on real processes (issue 46): a seeded Poisson load streamed through
# kvd control's front over N nodes (a kvd daemon and vLLM's OpenAI server each, on a real etcd),
# workers killed at set times, the recovery policies side by side, every stream checked against
# its uninterrupted greedy output (benches/python/lumen_load.py; its --help says everything).
#
#   scripts/bench-lumen.sh [OPTIONS]     (no options: the full experiment below)
#   scripts/bench-lumen.sh --smoke       (2 workers, a few seconds, one vLLM kill, lumen)
#   scripts/bench-lumen.sh --help
#
# The full experiment: 4 workers, a 16-layer tiny model 256 wide (a prefill several times its
# restore), 1.25 requests/s, a step's prefill capped at 256 tokens (every policy alike: no
# whole-prompt step holds a survivor), one failure and two at once (nodes 2 and 3: ring
# neighbours), lumen, fixed_ring and stop_restart alternating, 4 repetitions with the same seed;
# about 50 minutes. The table on stdout, lumen.json (raw records and figures) and lumen.svg (TTFT
# over arrival time, the kills marked) in the current folder. Pick --rate first with a run
# without --scenario: survivors busy but not saturated before the kill. A SIGTERM or SIGHUP
# stops the run and its engines (each vLLM server runs in its own session).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
    set -- --workers 4 --layers 16 --hidden 256 --rate 1.25 --duration 40 --output-len chat:1 --window 10 \
        --max-num-batched-tokens 256 --scenario 20:node:2 --scenario 20:node:2,20:node:3 \
        --policies lumen,fixed_ring,stop_restart --repeat 4 --seed 1 \
        --out lumen.json --svg lumen.svg
fi
for a in "$@"; do  # the help needs no build and no engine
    case "$a" in -h|--help) exec python3 benches/python/lumen_load.py --help ;; esac
done
target=$(realpath "${CARGO_TARGET_DIR:-target}")
echo "== building kvd and libkvd (release)"
cargo build --locked --release -p kvd -p kvd-ffi
venv=$(KVD_LIBKVD="$target/release/libkvd.so" scripts/engine-venv.sh)
command -v etcd >/dev/null || { echo "bench-lumen: etcd is missing (apt-get install etcd-server; scripts/test.sh installs it)"; exit 1; }
KVD_BIN="$target/release/kvd" exec "$venv/bin/python" benches/python/lumen_load.py "$@"
