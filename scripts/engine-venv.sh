#!/usr/bin/env bash
# The pinned engine environment (vLLM's CPU build, SGLang and what they import), built once per
# version of tests/engines/requirements.txt and reused while its pins match; prints its path.
#
#   scripts/engine-venv.sh            build it if needed (about 6 GB, a few minutes), print the path
#   KVD_ENGINE_VENV=DIR ...           use DIR instead of ~/.cache/kvd/engines-<hash of the pins>
#
# The venv lives outside the clone so that a fresh clone reuses it. It is installed with
# --no-deps from the full pin list (see the header of tests/engines/requirements.txt for why),
# then gets this checkout's kvd package (libkvd from target/debug, which must be built).
set -euo pipefail
cd "$(dirname "$0")/.."
reqs=tests/engines/requirements.txt
venv="${KVD_ENGINE_VENV:-$HOME/.cache/kvd/engines-$(sha256sum "$reqs" | cut -c1-16)}"
if [ ! -f "$venv/.complete" ]; then
    echo "== building the engine venv $venv (first run, or the pins changed)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -r "$reqs" >&2
    touch "$venv/.complete"
fi
lib="${KVD_LIBKVD:-$PWD/target/debug/libkvd.so}"
[ -f "$lib" ] || { echo "libkvd not built at $lib: run cargo build -p kvd-ffi first" >&2; exit 1; }
KVD_LIBKVD="$lib" "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    --force-reinstall ./ffi/python >&2
rm -rf ffi/python/build ffi/python/kvd.egg-info
echo "$venv"
