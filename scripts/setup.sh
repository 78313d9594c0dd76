#!/usr/bin/env bash
# One entry point for a fresh machine (README): create or reuse ./.venv, install torch==2.13.0
# FIRST (an unpinned torch resolved from scratch pulls a multi-GB CUDA build), then trainguard with
# its extras, then run what was asked.
#
#   bash scripts/setup.sh demo [trainguard demo args...]   # the 2-rank demo
#   bash scripts/setup.sh test [pytest args...]            # the whole test suite (what CI runs), then -- with no
#                                                          # args -- the support matrix's oldest row (compat.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-test}"; shift || true

PY="${PYTHON:-python3}"
VENV="${TRAINGUARD_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# Reinstall only when the requirements changed (setup.py, this script, the support matrix).
stamp="$VENV/.trainguard-installed"
want="$(cat setup.py scripts/setup.sh trainguard/support/releases.json | sha256sum | cut -c1-16)-$what"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q "torch==2.13.0"
  # the newest releases a fresh install resolves *inside* the support matrix (trainguard/support/releases.json): a newer
  # one would be refused at start until the matrix says otherwise
  PYTHONPATH=. python -c "from trainguard.support.releases import constraints; print(constraints(), end='')" > "$VENV/constraints.txt"
  # (PIP_CONSTRAINT replaces a constraint file pip's configuration names: that one is kept too)
  config_constraint="$(python -m pip config get global.constraint 2>/dev/null || true)"
  export PIP_CONSTRAINT="$(cd "$VENV" && pwd)/constraints.txt${config_constraint:+ $config_constraint}${PIP_CONSTRAINT:+ $PIP_CONSTRAINT}"
  if [ "$what" = "test" ]; then
    # the tests cover both adapters and Megatron-LM's loop on two releases (PLATFORM.md): megatron-core
    # 0.19.2 installed (the newest; its cp311 wheel holds megatron.training and asks for Python 3.12 but
    # runs on 3.11 -- test environments only; --no-deps: its resolver builds numpy from source; triton
    # 3.9.0, which its pipeline schedules import, loads without a GPU), 0.17.1 beside it (with
    # megatron.training, for Megatron-LM core_v0.17.1) and 0.16.1 (the newest whose metadata allows 3.11),
    # each put first on the workers' PYTHONPATH by the tests that run them
    python -m pip install -q -e ".[deepspeed,monitor,wandb,test,megatron]"
    python -m pip install -q "trl>=1.16,<1.17"  # (TRL's SFTTrainer: one of the zero-code entry's import shapes)
    python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2" "triton==3.9.0"
    python -m pip install -q --no-deps --upgrade --ignore-requires-python --target "$VENV/megatron-core-0.17.1" "megatron-core==0.17.1"
    python -m pip install -q --no-deps --upgrade --target "$VENV/megatron-core-0.16.1" "megatron-core==0.16.1"
    python -c "import megatron.core as m; assert m.__version__.split('+')[0] == '0.19.2', m.__version__"
  else
    python -m pip install -q -e ".[deepspeed,monitor,wandb,test]"
  fi
  python -c "import torch, deepspeed; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "$want" > "$stamp"
fi

# DeepSpeed compiles a small C++ op (deepspeed_shm_comm) at the first process-group start on CPU:
# cache it per machine, so CI and the demo compile it once.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ -d "$VENV/megatron-core-0.16.1/megatron" ] && export TRAINGUARD_MEGATRON_CORE_016="$(cd "$VENV/megatron-core-0.16.1" && pwd)"
[ -d "$VENV/megatron-core-0.17.1/megatron" ] && export TRAINGUARD_MEGATRON_CORE_017="$(cd "$VENV/megatron-core-0.17.1" && pwd)"

case "$what" in
  demo) exec trainguard demo "$@" ;;
  test)
    bash scripts/get_promtool.sh; bash scripts/get_slurm.sh
    python -m pytest -q tests "$@"
    if [ $# -eq 0 ]; then  # the whole suite ran (the newest releases): now the oldest row, in its own venv
      deactivate
      bash scripts/compat.sh oldest
    fi ;;
  *) echo "usage: bash scripts/setup.sh demo|test [args...]" >&2; exit 2 ;;
esac
