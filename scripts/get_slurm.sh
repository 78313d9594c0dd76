#!/usr/bin/env bash
# Best effort: install Debian's Slurm (slurm-wlm 22.05: slurmctld, slurmd, sbatch, scontrol) and munge, so
# that tests/dist/test_slurm_dist.py can start a single-host Slurm and submit scripts/launch/*.sbatch to it
# (tests/support/slurm.py). Needs root and apt; never fatal: without them those tests skip, saying why.
# Nothing is started here and no service is enabled: the tests start their own daemons and stop them.
set -u
command -v slurmctld >/dev/null && command -v sbatch >/dev/null && command -v munged >/dev/null && exit 0
[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || { echo "get_slurm: not root or no apt: the Slurm tests will skip" >&2; exit 0; }
export DEBIAN_FRONTEND=noninteractive
install() { timeout 600 apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null 2>&1; }
install || { timeout 300 apt-get update -qq >/dev/null 2>&1 && install; } || \
  echo "get_slurm: could not install slurm-wlm and munge: the Slurm tests will skip" >&2
exit 0
