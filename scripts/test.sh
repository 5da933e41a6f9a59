#!/usr/bin/env bash
# Installs what the tests need (CPU torch, the package, OpenSSH server, Debian's chromium, Slurm and munge) and runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null || need+=(openssh-client)
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && command -v sbatch >/dev/null || need+=(slurm-wlm)
[ -x /usr/sbin/munged ] || need+=(munge)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
# Two workers: tests/xdist_units.py says how they share the suite.
python3 -m pytest -n 2 --dist loadgroup "$@"
