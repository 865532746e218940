#!/usr/bin/env bash
# Run the fault drills (tests/drills.rs) several times and tabulate them: for each drill its
# outcome, detection and recovery times (min / median / max over the runs) and leaks found.
#
#   scripts/drills.sh            three runs (what docs/PERFORMANCE.md's drill table comes from)
#   scripts/drills.sh --runs 5   five runs
#   scripts/drills.sh --help
#
# Needs what the test command installs (etcd-server, iproute2) and root (network namespaces).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "drills.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
done
case "$runs" in ''|*[!0-9]*) echo "drills.sh: --runs takes a number" >&2; exit 2 ;; esac
[ "$runs" -ge 1 ] && [ "$runs" -le 20 ] || { echo "drills.sh: --runs 1 to 20" >&2; exit 2; }

results=$(mktemp)
trap 'rm -f "$results"' EXIT
cargo build --locked -q -p kvd --tests
for i in $(seq 1 "$runs"); do
    echo "== drills, run $i of $runs"
    KVD_DRILL_RESULTS="$results" cargo test --locked -q -p kvd --test drills -- \
        --test-threads=1 --nocapture 2>&1 | grep -E '^DRILL|test result|FAILED|panicked' || true
done
python3 - "$results" "$runs" <<'PY'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    rows.setdefault(r["drill"], []).append(r)
def span(vals):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    return f"{min(vals):.2f} / {statistics.median(vals):.2f} / {max(vals):.2f}"
print(f"\n| drill | fault | runs | detected, s (min / median / max) | recovered, s (min / median / max) | leaks |")
print("|---|---|---|---|---|---|")
for d in sorted(rows):
    rs = rows[d]
    fault = rs[-1]["fault"]
    print(f"| {d} | {fault} | {len(rs)} | {span([r['detected_s'] for r in rs])} | "
          f"{span([r['recovered_s'] for r in rs])} | {sum(r['leaks'] for r in rs)} |")
missing = int(sys.argv[2]) * len(rows) - sum(len(v) for v in rows.values())
if missing:
    print(f"\n{missing} drill runs did not report (failed before their line): see the output above")
    sys.exit(1)
PY
