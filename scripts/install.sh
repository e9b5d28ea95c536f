#!/usr/bin/env bash
# Installs ftsystem on a fresh Debian 12 machine (root, Python 3.11) into a virtual environment
# .venv at the repository root.
#
#   bash scripts/install.sh          what a job needs: etcd, util-linux (setpriv), iproute2
#                                    (network namespaces for --netns), torch and ftsystem
#   bash scripts/install.sh --test   also what the tests need: Prometheus (promtool), Chromium
#                                    (the status page's browser test), Podman with runc,
#                                    catatonit and mmdebstrap (the images built and the compose
#                                    job run, tests/test_containers.py), Slurm and munge (a
#                                    cluster of network namespaces that runs
#                                    docker/slurm/ftsystem.sbatch, tests/test_slurm.py), the [test] extra
#                                    (pytest, schemathesis, podman-compose, the simulators'
#                                    matplotlib and simpy) and the [torchtitan] extra
#                                    (tests/test_torchtitan.py; it leaves torch as pinned)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") test=0 ;;
  --test) test=1 ;;
  *) echo "usage: bash scripts/install.sh [--test]" >&2; exit 2 ;;
esac
missing=()
command -v etcd >/dev/null || missing+=(etcd-server)
command -v setpriv >/dev/null || missing+=(util-linux)
command -v ip >/dev/null || missing+=(iproute2)
if [ "$test" = 1 ]; then
  command -v prometheus >/dev/null || missing+=(prometheus)
  command -v chromium >/dev/null || missing+=(chromium)
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || missing+=(runc)  # docker/containers.conf: crun fails on these VMs
  [ -x /usr/libexec/podman/catatonit ] || missing+=(catatonit)  # compose's `init: true`
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)  # the test's base image
  # Slurm's daemons, its commands and munge: the tests run daemons of their own, with their own
  # configuration, never the system's services
  for pkg in slurm-wlm slurmctld slurmd slurm-client munge; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
fi
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned: this takes the CPU wheel on disk instead of a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
if [ "$test" = 1 ]; then
  .venv/bin/pip install -q -e '.[test,torchtitan]'
else
  .venv/bin/pip install -q -e .
fi
