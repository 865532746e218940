#!/usr/bin/env bash
# Fuzz kvd's decoders and its C ABI for a bounded time each, on the stable toolchain.
#
#   scripts/fuzz.sh            every target for 60 s (what the test command runs)
#   scripts/fuzz.sh 600        every target for 10 minutes
#   scripts/fuzz.sh 60 c_abi   one target
#
# The targets (fuzz/fuzz_targets/) are cargo-fuzz targets; with cargo-fuzz and nightly,
# `cargo fuzz run <target>` runs them too. This script needs neither: it builds them with
# libFuzzer's coverage instrumentation (the -C flags cargo-fuzz passes, which stable accepts),
# links libFuzzer (libfuzzer-sys builds it with the C++ compiler), and runs each on a copy of
# its committed corpus (fuzz/corpus/<target>), so a run does not rewrite the repository. A
# crash fails the script and leaves the input under fuzz/artifacts/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
only="${2:-}"
case "$seconds" in ''|*[!0-9]*) echo "fuzz.sh: the first argument is seconds per target" >&2; exit 2 ;; esac
targets=(local_protocol transport_wire c_abi)
[ -n "$only" ] && targets=("$only")

host=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
target_dir="$PWD/fuzz/target"
echo "== building libkvd with coverage instrumentation"
cargo build --locked --release -q -p kvd-ffi --target "$host" --target-dir "$target_dir/libkvd"
export KVD_LIBKVD_DIR="$target_dir/libkvd/$host/release"
# (clippy runs without the coverage flags, so it shares the main target folder's dependencies)
echo "== linting the fuzz targets (fmt, clippy)"
cargo fmt --manifest-path fuzz/Cargo.toml -- --check
env -u RUSTFLAGS cargo clippy --locked -q --manifest-path fuzz/Cargo.toml --bins \
    --target-dir "$PWD/target" -- -D warnings
echo "== building the fuzz targets"
cargo build --locked --release -q --manifest-path fuzz/Cargo.toml --target "$host" \
    --target-dir "$target_dir" --bins

printf '\n| target | seconds | executions | exec/s | coverage (cov) | features (ft) | corpus | crashes |\n|---|---|---|---|---|---|---|---|\n' > fuzz/target/summary.md
failed=0
for t in "${targets[@]}"; do
    echo "== fuzzing $t for ${seconds}s"
    work="$target_dir/corpus/$t"
    rm -rf "$work"
    mkdir -p "$work" "fuzz/artifacts/$t"
    cp -r "fuzz/corpus/$t/." "$work/" 2>/dev/null || true
    log="$target_dir/$t.log"
    set +e
    "$target_dir/$host/release/$t" "$work" -max_total_time="$seconds" -max_len=4096 \
        -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="fuzz/artifacts/$t/" > "$log" 2>&1
    rc=$?
    set -e
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    ft=$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | cut -d' ' -f2)
    corpus=$(ls "$work" | wc -l)
    crashes=$(ls "fuzz/artifacts/$t" | wc -l)
    echo "| $t | $seconds | ${execs:-?} | ${rate:-?} | ${cov:-?} | ${ft:-?} | $corpus | $crashes |" >> fuzz/target/summary.md
    if [ "$rc" != 0 ]; then
        echo "fuzz.sh: $t failed (exit $rc); the input is in fuzz/artifacts/$t/, the log's end:" >&2
        tail -40 "$log" >&2
        failed=1
    fi
done
cat fuzz/target/summary.md
exit "$failed"
