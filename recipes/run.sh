#!/usr/bin/env bash
# Run a verl-quads recipe: verl's stock GRPO command = <recipe>.args + modes/<mode>.args + your overrides.
#   bash recipes/run.sh grpo_math_qwen3_30b_a3b quads [more hydra overrides ...]
# Recipes: grpo_math_qwen3_30b_a3b, grpo_code_qwen3_30b_a3b, grpo_math_olmoe_1gpu.
# Modes:   bf16, fp8 (verl's own FP8 rollout), naive, quads, trace.
# An .args file holds one Hydra override per line ('#' lines are comments); ${oc.env:HOME} is resolved
# by verl's OmegaConf config, not by the shell. PYTHON selects the interpreter (default python3).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 2 ]; then
  sed -n '2,7p' "$0"; exit 2
fi
recipe="$here/$1.args"; mode="$here/modes/$2.args"; shift 2
[ -f "$recipe" ] || { echo "run.sh: no recipe $recipe" >&2; exit 2; }
[ -f "$mode" ] || { echo "run.sh: no mode $mode (have: $(ls "$here/modes" | sed 's/.args//' | tr '\n' ' '))" >&2; exit 2; }
args=()
while IFS= read -r line || [ -n "$line" ]; do
  case "$line" in ''|'#'*) continue;; esac
  args+=("$line")
done < <(cat "$recipe" "$mode")
set -x
exec "${PYTHON:-python3}" -m verl.trainer.main_ppo "${args[@]}" "$@"
