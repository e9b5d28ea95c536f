#!/usr/bin/env bash
# Installs what ftsystem needs on a fresh Debian 12 machine: etcd, Prometheus, util-linux
# (setpriv), iproute2 (network namespaces), Chromium (the status page's browser test), and a virtual environment .venv with
# the project and its test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v etcd >/dev/null || missing+=(etcd-server)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v setpriv >/dev/null || missing+=(util-linux)
command -v chromium >/dev/null || missing+=(chromium)
command -v ip >/dev/null || missing+=(iproute2)  # network namespaces (partition tests)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned: this takes the CPU wheel on disk instead of a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
