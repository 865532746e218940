#!/usr/bin/env bash
# A streaming request through kvd control's front surviving its worker's crash, measured: the
# cases of tests/engines/test_stream_recovery.py (etcd, three nodes each a daemon and vLLM's
# OpenAI server, the front), then one table of the run's figures.
#
#   scripts/bench-recovery.sh [FIGURES.json]
#
# Recovery time is kill -9 to the next token at the client; restored and recomputed tokens are
# vLLM's own counters on the survivor (prompt_tokens_by_source_total); decode rate is tokens per
# second at the client over an uninterrupted stream, with and without checkpointing; checkpoint
# bytes per token are what the holder's pool held per token its manifest covered. About ten
# minutes on two cores (most of it vLLM servers starting).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp --suffix=.json)}
cargo build --locked -p kvd -p kvd-ffi
venv=$(scripts/engine-venv.sh)
echo "== the stream-recovery cases (progress: one dot per case)"
(cd tests/engines && KVD_RECOVERY_FIGURES="$out" KVD_BIN="$PWD/../../target/debug/kvd" \
    KVD_LIBRARY="$PWD/../../target/debug/libkvd.so" PYTHONPATH="$PWD/../../ffi/python" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider test_stream_recovery.py)
"$venv/bin/python" - "$out" <<'PY'
import json, sys
f = json.load(open(sys.argv[1]))
r, s, n = f.get("restore", {}), f.get("stop_and_restart", {}), f.get("whole_node", {})
rows = [
    ("recovery, kill to next token (restore)", f"{r.get('recovery_ms_client')} ms", f"front saw {r.get('recovery_ms_front')} ms"),
    ("recovery, kill to next token (stop-and-restart)", f"{s.get('recovery_ms_client')} ms", f"front saw {s.get('recovery_ms_front')} ms"),
    ("history at the kill", f"{r.get('history_tokens')} tokens", "1,000-token prompt + committed"),
    ("restored / recomputed (restore)", f"{r.get('restored_tokens')} / {r.get('recomputed_tokens')}", f"checkpointed at the kill: {r.get('checkpointed_at_kill')}"),
    ("recomputed (stop-and-restart)", f"{s.get('recomputed_tokens')}", ""),
    ("whole node gone: recovery", f"{n.get('recovery_ms_client')} ms", f"loaded {n.get('load_tokens')}, recomputed {n.get('recompute_tokens')}"),
    ("decode, checkpointing on / off", f"{f.get('decode_tokens_per_s_checkpoint_on')} / {f.get('decode_tokens_per_s_checkpoint_off')} tokens/s", ""),
    ("checkpoint pool bytes per token", f"{f.get('checkpoint_pool_bytes_per_token')}", "64 KiB page per 32-token block"),
]
w = max(len(a) for a, _, _ in rows)
for a, b, c in rows:
    print(f"{a:<{w}}  {b:>22}  {c}")
print(f"(figures: {sys.argv[1]})")
PY
