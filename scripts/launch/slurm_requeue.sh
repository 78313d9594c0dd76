#!/usr/bin/env bash
# The end of a trainguard job under Slurm (scripts/launch/slurm_deepspeed.sbatch, scripts/megatron/slurm_gpt.sbatch
# exec it with the launch's exit code):
#
#   exec bash scripts/launch/slurm_requeue.sh RC LOG_DIR
#
# A hang (the watchdog's marker file TRAINGUARD_HANG_MARKER, or exit 75) or a killed node (137): requeue the
# job, excluding the hosts in LOG_DIR/suspect_hosts.json (trainguard's suspect_rank) on top of what the job
# already excludes, and with TRAINGUARD_DRAIN_SUSPECTS=1 (an administrator's right) drain them with the reason.
# Anything else (a crash, a TrainguardAbort: recovery ran out of budget) is not requeued: a person looks at the
# abort report first. Exits RC. Tested against a real single-host Slurm: tests/dist/test_slurm_dist.py.
set -uo pipefail
rc=${1:?usage: slurm_requeue.sh RC LOG_DIR}
LOG_DIR=${2:-$PWD}
TRAINGUARD_HANG_MARKER=${TRAINGUARD_HANG_MARKER:-}

if [ "$rc" -ne 0 ] && { { [ -n "$TRAINGUARD_HANG_MARKER" ] && [ -s "$TRAINGUARD_HANG_MARKER" ]; } || [ "$rc" -eq 75 ] || [ "$rc" -eq 137 ]; }; then
  # the hosts trainguard named suspect (suspect_rank: repeated anomalies on different data, a replica outvoted by
  # its group, a persistent straggler), added to what this job already excludes: the exclusion outlives later
  # requeues of the job
  SUSPECT=$(python -c "import json,sys; print(' '.join(json.load(open(sys.argv[1]))['hosts']))" \
            "$LOG_DIR/suspect_hosts.json" 2>/dev/null || true)
  CURRENT=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
  [ "$CURRENT" = "(null)" ] && CURRENT=""
  EXCLUDE=$( { [ -n "$CURRENT" ] && scontrol show hostnames "$CURRENT"; for h in $SUSPECT; do echo "$h"; done; } \
            | sort -u | paste -sd, -)
  if [ -n "$SUSPECT" ] && [ "${TRAINGUARD_DRAIN_SUSPECTS:-0}" = 1 ]; then
    # (an administrator's right: the hosts leave every job's allocation until someone resumes them)
    for h in $SUSPECT; do
      scontrol update NodeName="$h" State=DRAIN Reason="trainguard: suspect, see $LOG_DIR/suspect_hosts.json" || true
    done
  fi
  echo "trainguard: requeueing job $SLURM_JOB_ID (exit $rc$( [ -n "$TRAINGUARD_HANG_MARKER" ] && [ -s "$TRAINGUARD_HANG_MARKER" ] && echo ', a hang'))${EXCLUDE:+ without $EXCLUDE}" >&2
  # Slurm changes the node list of a pending job only: requeue first, then exclude. The requeue sends this
  # script SIGTERM (and SIGKILL KillWait seconds later); the exclusion is made in between.
  trap '' TERM
  scontrol requeue "$SLURM_JOB_ID"
  if [ -n "$EXCLUDE" ]; then
    for _ in $(seq 1 20); do
      scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE" 2>/dev/null && break
      sleep 0.5
    done
  fi
fi
exit "$rc"
