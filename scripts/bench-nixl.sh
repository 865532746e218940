#!/usr/bin/env bash
# NIXL beside kvd: the same host-memory transfer through NIXL's UCX backend over TCP
# (benches/python/nixl_transfer.py) and through kvd's TCP transfer engine (kvd-bench transfer),
# alternating round by round, then one table of both. See --help.
set -euo pipefail
cd "$(dirname "$0")/.."

# The NIXL environment's pins: installed with --no-deps, since the wheel declares torch (about
# 5 GB with its CUDA libraries) and host-memory transfers never import it.
PINS="nixl-cu12==1.5.1 numpy==2.4.6"

usage() {
    cat <<'EOF'
scripts/bench-nixl.sh [--rounds N] [--gib-per-case G] [--layout contiguous|scattered|both] [--out DIR]

Measures host-memory (DRAM) transfers between two processes on loopback, two ways, and prints
one table of both:

  NIXL  benches/python/nixl_transfer.py: NIXL's Python API (nixl-cu12, UCX backend,
        UCX_TLS=tcp,self, UCX_NET_DEVICES=lo): 128-block transfer requests, two 128-block
        regions on each side alternating, two requests in flight, WRITE (initiator -> target)
        and READ (target -> initiator), 1 MiB and 4 MiB blocks.
  kvd   target/release/kvd-bench transfer --block-kib 1024,4096 --checksum off --repeat 1:
        kvd's TCP transfer engine on the same shape (batches of 128, two in flight, two halves).

Each of R rounds runs NIXL, then kvd-bench. The table gives, per block size and direction, the
median GB/s over the rounds with [min-max], and kvd / NIXL (of the medians). GB = 1e9 bytes.

Options:
  --rounds N          rounds (default 3)
  --gib-per-case G    GiB moved per case, at least, both tools (default 1)
  --layout L          where NIXL's blocks of one request lie: contiguous (default; kvd-bench's
                      layout, which NIXL merges into one descriptor per request), scattered (the
                      two regions interleaved, so each block stays a transfer of its own), or
                      both (one NIXL row per layout)
  --out DIR           keep the raw outputs (NIXL JSON, kvd-bench tables) in DIR
  -h, --help          this text

How long: about a minute per round on a 2-core machine (NIXL about 15 s per layout, kvd-bench
about 40 s with its memcpy and raw TCP bounds), so about 3 minutes with the defaults. The first
run also creates the NIXL venv (~/.cache/kvd/nixl-venv, or KVD_NIXL_VENV; about 350 MB from
PyPI, a minute) and builds kvd-bench in release if target/release/kvd-bench is missing
(several minutes). Loopback throughput on a small shared machine drifts: compare within one run.
Progress goes to stderr, the table to stdout. Not part of scripts/test.sh.
EOF
}

rounds=3
gib=1
layout=contiguous
keep=""
while [ $# -gt 0 ]; do
    case "$1" in
        --rounds) rounds=${2:?--rounds needs a number}; shift 2 ;;
        --gib-per-case) gib=${2:?--gib-per-case needs a number}; shift 2 ;;
        --layout) layout=${2:?--layout needs a value}; shift 2 ;;
        --out) keep=${2:?--out needs a directory}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "bench-nixl: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "bench-nixl: --rounds takes a positive integer" >&2; exit 2; }
[[ "$gib" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "bench-nixl: --gib-per-case takes a number" >&2; exit 2; }
case "$layout" in
    contiguous|scattered) layouts=("$layout") ;;
    both) layouts=(contiguous scattered) ;;
    *) echo "bench-nixl: --layout takes contiguous, scattered or both" >&2; exit 2 ;;
esac

say() { echo "bench-nixl: $*" >&2; }

# --- the NIXL venv: created once, reused while its pins match ----------------------------------
venv="${KVD_NIXL_VENV:-$HOME/.cache/kvd/nixl-venv}"
if [ ! -f "$venv/.complete" ] || [ "$(cat "$venv/.complete")" != "$PINS" ]; then
    say "creating the NIXL venv $venv ($PINS)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086  # the pins are words
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps $PINS >&2
    echo "$PINS" > "$venv/.complete"
fi
py="$venv/bin/python"

# --- kvd-bench ---------------------------------------------------------------------------------
bench=target/release/kvd-bench
if [ ! -x "$bench" ]; then
    say "building $bench"
    cargo build --release --locked -p kvd-bench >&2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
results="$out/results.tsv"   # tool layout direction kib gbps round
: > "$results"

for r in $(seq 1 "$rounds"); do
    for l in "${layouts[@]}"; do
        say "round $r of $rounds: NIXL ($l)"
        timeout 600 "$py" benches/python/nixl_transfer.py --block-kib 1024,4096 \
            --direction write,read --gib-per-case "$gib" --layout "$l" \
            --json "$out/nixl-$l-$r.json" > "$out/nixl-$l-$r.txt"
        cat "$out/nixl-$l-$r.txt" >&2
        # nixl write 1024 KiB: 5.12 GB/s
        awk -v l="$l" -v r="$r" '$1 == "nixl" && $4 == "KiB:" && $6 == "GB/s" {
            print "nixl", l, $2, $3, $5, r }' "$out/nixl-$l-$r.txt" >> "$results"
    done
    say "round $r of $rounds: kvd-bench transfer"
    timeout 600 "$bench" transfer --block-kib 1024,4096 --checksum off --repeat 1 \
        --gib-per-case "$gib" > "$out/kvd-$r.txt"
    # write  1024 KiB blocks, checksum off            1.44  1.44..1.44 ...
    awk -v r="$r" '($1 == "write" || $1 == "read") && $3 == "KiB" && $4 == "blocks," \
        && $6 == "off" { print "kvd", "-", $1, $2, $7, r }' "$out/kvd-$r.txt" >> "$results"
    grep -E '^(write|read) ' "$out/kvd-$r.txt" >&2 || true
done

if [ -n "$keep" ]; then
    mkdir -p "$keep"
    cp "$out"/* "$keep"/
    say "raw outputs in $keep"
fi

"$py" - "$results" "$rounds" "$gib" "${layouts[*]}" <<'EOF'
import statistics
import sys

path, rounds, gib, layouts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split()
rows = {}
for line in open(path):
    tool, layout, direction, kib, gbps, _round = line.split()
    rows.setdefault((tool, layout, direction, int(kib)), []).append(float(gbps))


def cell(xs):
    if not xs:
        return "-"
    return f"{statistics.median(xs):5.2f} [{min(xs):.2f}-{max(xs):.2f}]"


missing = []
head = f"{'block':>9} {'dir':<6}" + (f" {'NIXL layout':<11}" if len(layouts) > 1 else "")
print()
print(f"{head} {'NIXL GB/s':>18} {'kvd GB/s':>18} {'kvd/NIXL':>9}")
for kib in (1024, 4096):
    for d in ("write", "read"):
        kvd = rows.get(("kvd", "-", d, kib), [])
        for layout in layouts:
            nixl = rows.get(("nixl", layout, d, kib), [])
            for name, xs in (("NIXL", nixl), ("kvd", kvd)):
                if len(xs) != rounds:
                    missing.append(f"{name} {d} {kib} KiB: {len(xs)} of {rounds} rounds")
            ratio = (f"{statistics.median(kvd) / statistics.median(nixl):9.2f}"
                     if kvd and nixl else f"{'-':>9}")
            lead = f"{kib:>5} KiB {d:<6}" + (f" {layout:<11}" if len(layouts) > 1 else "")
            print(f"{lead} {cell(nixl):>18} {cell(kvd):>18} {ratio}")
print(f"\n{rounds} rounds, >= {gib} GiB per case; median [min-max] over the rounds; "
      "128-block requests (batches), two in flight, two regions alternating; "
      f"NIXL layout {', '.join(layouts)}; kvd checksum off.")
if missing:
    print("missing results: " + "; ".join(sorted(set(missing))), file=sys.stderr)
    sys.exit(1)
EOF
