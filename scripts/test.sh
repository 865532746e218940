#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine or a warm one.
#
#   scripts/test.sh            install what is missing, then lint and run every test
#   KVD_SKIP_INSTALL=1 ...     skip the package check (offline machines)
#
# It installs the Debian packages that kvd's tests and builds need when they are missing, so a
# later issue that needs one more package adds one word to APT_PACKAGES.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages the build and the tests need (one word each):
#   etcd-server        cluster-mode tests start a real etcd on loopback
#   protobuf-compiler libprotobuf-dev   the etcd client's gRPC code generation
#   cmake libclang-dev pkg-config        bindgen-based -sys crates (RDMA verbs)
#   libibverbs-dev     RDMA verbs headers (the rdma feature is compiled, not run, here)
#   fonts-dejavu-core  the font `kvd sim` renders plot text with (sim_cli test draws the PNGs)
APT_PACKAGES=(etcd-server protobuf-compiler libprotobuf-dev cmake libclang-dev pkg-config libibverbs-dev fonts-dejavu-core)

install_missing() {
    [ "${KVD_SKIP_INSTALL:-0}" = 1 ] && return 0
    command -v dpkg-query >/dev/null || return 0
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "== installing: ${missing[*]}"
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    command -v cargo-nextest >/dev/null || echo "note: cargo-nextest not found; using cargo test"
}

install_missing

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== what engines and routers link (libkvd, kvd-client, kvd-control) has none of the daemon's dependencies"
python3 scripts/check-deps.py

# The library crates build and test on their own (their own features, not the workspace's);
# the rest of the workspace is tested together.
LIB_CRATES=(kvd-core kvd-client kvd-store kvd-control kvd-sim)
exclude=()
for p in "${LIB_CRATES[@]}"; do exclude+=(--exclude "$p"); done

echo "== tests"
if command -v cargo-nextest >/dev/null; then
    for p in "${LIB_CRATES[@]}"; do
        echo "== tests: $p on its own"
        cargo nextest run --locked --no-fail-fast -p "$p"
    done
    echo "== tests: the rest of the workspace"
    cargo nextest run --workspace --locked --no-fail-fast "${exclude[@]}"
    # nextest does not run doc tests
    cargo test --workspace --locked --doc
else
    for p in "${LIB_CRATES[@]}"; do cargo test --locked --no-fail-fast -p "$p"; done
    cargo test --workspace --locked --no-fail-fast "${exclude[@]}"
fi

echo "== model-checked store concurrency (shuttle)"
cargo test --locked -p kvd-store --features shuttle --test shuttle_store
