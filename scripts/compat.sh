#!/usr/bin/env bash
# The support matrix, measured (issue 32): the smoke (`pytest -m smoke`: a skipped step, a rollback, an exact
# resume, a zero-code Hugging Face Trainer run naming its bad sample, the install changing nothing) on each row of
# trainguard/support/releases.json's "rows", each in a venv of its own (torch==2.13.0 first, then the row's DeepSpeed,
# transformers and Accelerate, then trainguard without dependencies); then a table, release x feature, dated.
#
#   bash scripts/compat.sh            # every row (~5 minutes a row on 2 cores, the first time)
#   bash scripts/compat.sh oldest     # the named rows only (CI runs the oldest, beside the full suite on the newest)
#
# Venvs live under ${TRAINGUARD_COMPAT_DIR:-.venv-compat}/<row> and are reused while the row is unchanged.
# Exit status: non-zero when a feature of a row failed (or did not run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DIR="${TRAINGUARD_COMPAT_DIR:-.venv-compat}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

rows() {  # "name deepspeed transformers accelerate", one row a line
  "$PY" -c 'import json, sys
for r in json.load(open("trainguard/support/releases.json"))["rows"]:
    if len(sys.argv) == 1 or r["row"] in sys.argv[1:]:
        print(r["row"], r["deepspeed"], r["transformers"], r["accelerate"])' "$@"
}

selected="$(rows "$@")"
[ -n "$selected" ] || { echo "compat.sh: no row named $* in trainguard/support/releases.json" >&2; exit 2; }
status=0
while read -r name ds tf acc; do
  venv="$DIR/$name"
  want="$ds $tf $acc $(sha256sum setup.py scripts/compat.sh | sha256sum | cut -c1-16)"
  if [ "$(cat "$venv/.row" 2>/dev/null)" != "$want" ]; then
    echo "== compat.sh: row $name: installing DeepSpeed $ds, transformers $tf, Accelerate $acc into $venv"
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
    "$venv/bin/python" -m pip install -q "deepspeed==$ds" "transformers==$tf" "accelerate==$acc" \
      "pytest>=7" "pytest-timeout>=2.1" "pyyaml>=6" psutil
    "$venv/bin/python" -m pip install -q --no-deps -e .
    echo "$want" > "$venv/.row"
  fi
  echo "== compat.sh: row $name: the smoke (pytest -m smoke)"
  report="$DIR/$name.smoke.json"
  rm -f "$report"
  # (its own cache of DeepSpeed's CPU op: two environments sharing one rebuild it each time the other used it)
  # (TRAINGUARD_REQUIRE is the main suite's: a row of the matrix runs the smoke its releases can run)
  env -u TRAINGUARD_REQUIRE TORCH_EXTENSIONS_DIR="$venv/torch_extensions" TRAINGUARD_SMOKE_REPORT="$report" "$venv/bin/python" -m pytest -q -p no:cacheprovider -m smoke tests/dist \
    || status=1
done <<< "$selected"

"$PY" - "$DIR" $(echo "$selected" | cut -d' ' -f1) <<'EOF' || status=1
import datetime, json, os, sys
folder, names = sys.argv[1], sys.argv[2:]
rows = {r["row"]: r for r in json.load(open("trainguard/support/releases.json"))["rows"]}
features = ["skip", "rollback", "resume", "reshard", "zero-code HF Trainer", "install"]
print(f"\nsupport matrix smoke, {datetime.date.today()} (Python {sys.version.split()[0]}, torch 2.13.0, 2 CPU ranks, gloo)\n")
print("| row | DeepSpeed | transformers | Accelerate | " + " | ".join(features) + " |")
print("|---|---|---|---|" + "---|" * len(features))
missing = False
for name in names:
    path = os.path.join(folder, f"{name}.smoke.json")
    seen = json.load(open(path)) if os.path.exists(path) else {}
    r = rows[name]
    cells = [seen.get(f, "did not run") for f in features]
    # ("refused by name": a feature the matrix refuses on that release, the refusal itself tested)
    missing |= any(c not in ("passed", "refused by name") for c in cells)
    print(f"| {name} | {r['deepspeed']} | {r['transformers']} | {r['accelerate']} | " + " | ".join(cells) + " |")
sys.exit(1 if missing else 0)
EOF
exit $status
