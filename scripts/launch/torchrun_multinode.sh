#!/usr/bin/env bash
# DeepSpeed + trainguard on several nodes under torchrun, with restarts.
#
# Run the same command on every node (or let scripts/launch/slurm_deepspeed.sbatch do it):
#   NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=node0 bash scripts/launch/torchrun_multinode.sh \
#       train.py --deepspeed_config ds_config.json
#
# What happens on a failure (see README, "Restarts and exit codes"):
# - a rank dies (SIGKILL, OOM, a node crash): torchrun stops the others and, while MAX_RESTARTS
#   lasts, starts the job again; trainguard resumes from the newest checkpoint that verifies;
# - a rank hangs: trainguard's watchdog names it (hang_detected), dumps stacks, and every live rank
#   exits with distributed.watchdog.exit_code (75): torchrun restarts the same way;
# - MIN_NODES < NNODES lets the job continue on fewer nodes (elastic): trainguard resumes at the new
#   data-parallel size (ZeRO 1-3, via DeepSpeed's universal checkpoint) with the data position re-split.
set -euo pipefail

: "${NNODES:=1}"
: "${MIN_NODES:=$NNODES}"
: "${NPROC_PER_NODE:=8}"
: "${MASTER_ADDR:=127.0.0.1}"
: "${MASTER_PORT:=29500}"
: "${MAX_RESTARTS:=3}"
: "${RDZV_ID:=trainguard-${USER:-job}}"

if [ "$#" -lt 1 ]; then
  echo "usage: $0 TRAIN_SCRIPT [ARGS...]" >&2
  exit 2
fi

exec torchrun \
  --nnodes="${MIN_NODES}:${NNODES}" \
  --nproc-per-node="${NPROC_PER_NODE}" \
  --max-restarts="${MAX_RESTARTS}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv-id="${RDZV_ID}" \
  "$@"
