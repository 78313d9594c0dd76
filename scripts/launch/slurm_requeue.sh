#!/usr/bin/env bash
# The end of a trainguard job under Slurm (scripts/launch/slurm_deepspeed.sbatch, scripts/megatron/slurm_gpt.sbatch
# exec it with the launch's exit code):
#
#   exec bash scripts/launch/slurm_requeue.sh RC LOG_DIR
#
# A hang (the watchdog's marker file TRAINGUARD_HANG_MARKER, or exit 75) or a killed node (137): requeue the
# job, excluding the hosts in LOG_DIR/suspect_hosts.json (trainguard's suspect_rank) on top of what the job
# already excludes, and with TRAINGUARD_DRAIN_SUSPECTS=1 (an administrator's right) drain them with the reason --
# only this job's file, only this job's nodes (suspects() below), every scontrol failure logged.
# Anything else (a crash, a TrainguardAbort: recovery ran out of budget) is not requeued: a person looks at the
# abort report first. Exits RC. Tested against a real single-host Slurm: tests/dist/test_slurm_dist.py.
set -uo pipefail
set -f  # no name read from a file is ever globbed
rc=${1:?usage: slurm_requeue.sh RC LOG_DIR}
LOG_DIR=${2:-$PWD}
TRAINGUARD_HANG_MARKER=${TRAINGUARD_HANG_MARKER:-}

say() { echo "trainguard: $*" >&2; }
# a file this job's own user wrote and alone may write (a regular file, not a link): what a hang marker or the suspect
# file must be before it is acted on -- one planted by anyone else who can write LOG_DIR changes nothing
owned() { [ -n "$(find "$1" -maxdepth 0 -type f -user "$(id -u)" ! -perm /022 2>/dev/null)" ]; }

# The suspect hosts this job may act on, one per line: LOG_DIR/suspect_hosts.json only when it carries this job's id
# (a previous job's file, or one anyone who can write LOG_DIR left there, acts on nothing), and of its hosts only
# those that are nodes of this job (scontrol show hostnames $SLURM_JOB_NODELIST) -- a name with anything but letters,
# digits, '.', '_' and '-' (a glob, a node range like gpu[001-512], a comma list) never gets through; a fully
# qualified name whose first label is one of the job's nodes is taken as that node. Every name set aside is logged.
suspects() {
  local file="$LOG_DIR/suspect_hosts.json" nodes err
  [ -f "$file" ] || return 0
  err=$(mktemp)
  if ! nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>"$err"); then
    say "scontrol show hostnames failed ($(cat "$err")): no suspect host acted on"
    rm -f "$err"
    return 0
  fi
  [ -s "$err" ] && say "scontrol show hostnames: $(cat "$err")"  # (a warning is logged, never taken for a node)
  rm -f "$err"
  "${PYTHON:-python3}" - "$file" "${SLURM_JOB_ID:-}" "$nodes" <<'PY'
import json, os, re, stat, sys
path, job, nodes = sys.argv[1], sys.argv[2], set(sys.argv[3].split())
name = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        sys.exit(f"trainguard: {path} is not a regular file of this job's user that only it may write (owner uid "
                 f"{st.st_uid}, mode {st.st_mode & 0o777:o}): ignored -- anyone who can write its folder could have "
                 "put it there")
    data = json.load(os.fdopen(fd))
    hosts, written_by = data["hosts"], data.get("job_id")
except Exception as e:
    sys.exit(f"trainguard: {path} unreadable ({type(e).__name__}: {e}): no suspect host acted on")
if not job or str(written_by) != job:
    sys.exit(f"trainguard: {path} was written by job {written_by!r}, not this job ({job or 'unknown'}): ignored")
for h in hosts:
    h = str(h)
    if not name.fullmatch(h):
        print(f"trainguard: suspect host {h!r} set aside: not a plain host name", file=sys.stderr)
    elif h in nodes:
        print(h)
    elif h.split(".")[0] in nodes:
        print(h.split(".")[0])
    else:
        print(f"trainguard: suspect host {h!r} set aside: not a node of this job", file=sys.stderr)
PY
}

hung=0
if [ -n "$TRAINGUARD_HANG_MARKER" ] && [ -s "$TRAINGUARD_HANG_MARKER" ]; then
  if owned "$TRAINGUARD_HANG_MARKER"; then hung=1
  else say "$TRAINGUARD_HANG_MARKER is not this job's user's own file (a link, another owner, or writable by others): ignored"
  fi
fi
if [ "$rc" -ne 0 ] && { [ "$hung" -eq 1 ] || [ "$rc" -eq 75 ] || [ "$rc" -eq 137 ]; }; then
  # the hosts trainguard named suspect (suspect_rank: repeated anomalies on different data, a replica outvoted by
  # its group, a persistent straggler), added to what this job already excludes: the exclusion outlives later
  # requeues of the job
  mapfile -t SUSPECT < <(suspects | sort -u)
  CURRENT=""
  if job=$(scontrol show job -o "$SLURM_JOB_ID" 2>&1); then
    CURRENT=$(grep -o 'ExcNodeList=[^ ]*' <<<"$job" | cut -d= -f2)
  else
    say "scontrol show job $SLURM_JOB_ID failed: $job"
  fi
  [ "$CURRENT" = "(null)" ] && CURRENT=""
  EXCLUDE=$( { [ -n "$CURRENT" ] && scontrol show hostnames "$CURRENT"; printf '%s\n' "${SUSPECT[@]}"; } \
            | grep -v '^$' | sort -u | paste -sd, -)
  if [ "${#SUSPECT[@]}" -gt 0 ] && [ "${TRAINGUARD_DRAIN_SUSPECTS:-0}" = 1 ]; then
    # (an administrator's right: the hosts leave every job's allocation until someone resumes them)
    for h in "${SUSPECT[@]}"; do
      if ! out=$(scontrol update NodeName="$h" State=DRAIN Reason="trainguard: suspect, see $LOG_DIR/suspect_hosts.json" 2>&1); then
        say "scontrol could not drain $h: $out"
      fi
    done
  fi
  say "requeueing job $SLURM_JOB_ID (exit $rc$( [ "$hung" -eq 1 ] && echo ', a hang'))${EXCLUDE:+ without $EXCLUDE}"
  # Slurm changes the node list of a pending job only: requeue first, then exclude. The requeue sends this
  # script SIGTERM (and SIGKILL KillWait seconds later); the exclusion is made in between.
  trap '' TERM
  if ! out=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
    say "scontrol requeue $SLURM_JOB_ID failed: $out"
  fi
  if [ -n "$EXCLUDE" ]; then
    excluded=0
    for _ in $(seq 1 20); do
      if out=$(scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$EXCLUDE" 2>&1); then excluded=1; break; fi
      sleep 0.5
    done
    [ "$excluded" = 1 ] || say "scontrol could not exclude $EXCLUDE from job $SLURM_JOB_ID: $out"
  fi
fi
exit "$rc"
