#!/usr/bin/env bash
# The deployment files (deploy/) checked by the tools operators use and against a real daemon:
# kubectl kustomize + kubernetes-validate (schemas shipped, no cluster), systemd-analyze verify,
# promtool check/test rules, and a scrape of real daemons for every metric the dashboard and the
# alerts name (deploy/tests/test_deploy.py says what each test shows).
#
#   scripts/check-deploy.sh          (after cargo build -p kvd -p kvd-ffi; scripts/test.sh runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
need() { command -v "$1" >/dev/null || { echo "check-deploy: $1 is missing ($2)"; exit 1; }; }
# kubectl: Debian's kubernetes-client, unless a kubectl is there already (both own /usr/bin/kubectl).
if ! command -v kubectl >/dev/null && [ "${KVD_SKIP_INSTALL:-0}" != 1 ]; then
    sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends kubernetes-client
fi
need kubectl "apt-get install kubernetes-client"
need promtool "apt-get install prometheus (scripts/test.sh installs it)"
need etcd "apt-get install etcd-server"
venv=target/deployvenv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check pytest==9.2.0 pyyaml==6.0.3 kubernetes-validate==1.37.0
KVD_LIBKVD="$PWD/target/debug/libkvd.so" "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps ./ffi/python
rm -rf ffi/python/build ffi/python/kvd.egg-info
set +e
PATH="$PWD/$venv/bin:$PATH" KVD_BIN="$PWD/target/debug/kvd" "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider deploy/tests
rc=$?
set -e
[ "$rc" = 5 ] && { echo "pytest collected no tests in deploy/tests"; exit 1; }
exit "$rc"
