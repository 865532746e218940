#!/usr/bin/env bash
# The CUDA paths on a machine with an NVIDIA GPU and driver (development machines have none):
#   1. build the CUDA crates with --features cuda,
#   2. the transport's unit tests with the feature (the registration plan, the copy checks and
#      the event bookkeeping over the test double, and the real driver opening),
#   3. transport/examples/gpu_check.rs: a memfd pool registered with the chunked plan, H2D and
#      D2H GB/s of 2.5 MiB blocks, whole and as 64-layer scatter lists, next to cuMemcpy with
#      cuMemHostAlloc memory in the same run (the bound); it fails on any byte mismatch.
# Usage: scripts/gpu-check.sh [SECONDS_PER_CASE]   (default 1; each case also stops at 1000 rounds)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-1}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no working nvidia-smi here; this check needs an NVIDIA GPU and driver" >&2
    exit 2
fi
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader || true

echo "== build with --features cuda"
cargo build --release -p kvd-transport -p kvd-client -p kvd-ffi --features cuda

echo "== kvd-transport unit tests with --features cuda"
cargo test --release -p kvd-transport --features cuda

echo "== kvd-client unit tests with --features cuda"
cargo test --release -p kvd-client --features cuda --lib

echo "== gpu_check: registered pool vs cuMemHostAlloc bound (${seconds}s per case)"
cargo run --release -p kvd-transport --features cuda --example gpu_check -- "$seconds"
echo "gpu-check: passed"
