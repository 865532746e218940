#!/usr/bin/env bash
# The bindings' overhead, measured in one run: the same lookup of 128 tags and put/get of
# 64 x 2.5 MiB pages through the Rust client (kvd-bench bindings), libkvd from C
# (benches/c/bindings.c) and the Python package (benches/python/bindings.py), one after the
# other against one release-built daemon, for ROUNDS rounds (default 3); the order rotates from
# round to round, so that no binding always runs first on a warm or cold memory system.
#
#   scripts/bench-bindings.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
iters=${KVD_BENCH_ITERS:-20}
lookups=${KVD_BENCH_LOOKUPS:-300}

cargo build --release --locked -p kvd -p kvd-bench -p kvd-ffi
rel=$PWD/target/release
out=$(mktemp -d)
trap 'kill "$daemon" 2>/dev/null || true; rm -rf "$out"' EXIT

cc -std=c11 -O2 -Wall -Wextra -Werror -I include benches/c/bindings.c -o "$out/bindings-c" \
    -L "$rel" -Wl,-rpath,"$rel" -lkvd
venv=target/pyvenv-bench
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check numpy
KVD_LIBKVD="$rel/libkvd.so" "$venv/bin/pip" install --quiet --disable-pip-version-check \
    --force-reinstall --no-deps ./ffi/python
rm -rf ffi/python/build ffi/python/kvd.egg-info

"$rel/kvd" serve --data-dir "$out/data" --socket "$out/kvd.sock" --admin-listen 127.0.0.1:0 \
    --pool-mib 1024 --page-kib 2560 > "$out/ready" 2> "$out/daemon.log" &
daemon=$!
for _ in $(seq 1 600); do
    grep -q '^kvd ready' "$out/ready" 2>/dev/null && break
    sleep 0.1
done
grep -q '^kvd ready' "$out/ready" || { cat "$out/daemon.log"; exit 1; }

results="$out/results"
run_one() {
    case "$1" in
        rust) "$rel/kvd-bench" bindings --socket "$out/kvd.sock" --seed "$2" --iters "$iters" \
                  --lookups "$lookups" ;;
        c) "$out/bindings-c" "$out/kvd.sock" "$2" "$iters" "$lookups" ;;
        python) "$venv/bin/python" benches/python/bindings.py "$out/kvd.sock" "$2" "$iters" "$lookups" ;;
    esac
}
order=(rust c python)
for round in $(seq 1 "$rounds"); do
    for i in 0 1 2; do
        b=${order[$(( (i + round - 1) % 3 ))]}
        run_one "$b" $((round * 10 + i)) | tee -a "$results"
    done
done

# The table: per binding and measurement, the median over the rounds of p50, p99 and GB/s,
# and the ratio of GB/s to the Rust client's.
python3 - "$results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    _, binding, what, *kv = line.split()
    vals = dict(x.split("=") for x in kv)
    rows.setdefault((what, binding), []).append({k: float(v) for k, v in vals.items()})
med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in rows.items()}
print(f"\n{'what':<14} {'binding':<7} {'p50 us':>9} {'p99 us':>9} {'GB/s':>7} {'vs rust':>8}")
for what in ("lookup128", "put64x2.5MiB", "get64x2.5MiB"):
    rust = med.get((what, "rust"), {})
    for binding in ("rust", "c", "python"):
        m = med.get((what, binding))
        if not m:
            continue
        if what == "lookup128":
            ratio = f"{m['p50_us'] / rust['p50_us']:.2f}x" if rust else ""
            gb = "-"
        else:
            ratio = f"{m['gbps'] / rust['gbps']:.2f}" if rust else ""
            gb = f"{m['gbps']:.2f}"
        print(f"{what:<14} {binding:<7} {m['p50_us']:>9.1f} {m['p99_us']:>9.1f} {gb:>7} {ratio:>8}")
print("(lookup: ratio of p50 latency to the Rust client's; put/get: ratio of GB/s)")
PY
