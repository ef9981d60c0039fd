#!/usr/bin/env bash
# Regenerate every generated file of the switch-1t recipe and every figure its README quotes.
#
#   recipes/switch-1t/regenerate.sh          # from anywhere; uses .venv/bin if present, else PATH
#
# For each (cluster, GPUs) of the recipe it runs, and keeps the exact output of:
#   piper plan switch-1t --cluster C --gpus N --gbs 2048 --detail \
#        --export-megatron generated/megatron/C-N.sh --plot generated/figures/C-N
#                                             -> generated/outputs/plan-C-N.txt
#   ./megatron.sh C N --plan-only             -> generated/outputs/megatron-C-N.txt (rank 0 at launch)
#   python deepspeed_plan.py --cluster C --gpus N --out generated/deepspeed/C-N.json
#                                             -> generated/outputs/deepspeed-C-N.txt
#   piper predict switch-1t --cluster C --gpus N --parallel "<the DeepSpeed plan>"
#                                             -> generated/outputs/predict-deepspeed-C-N.txt
#                                                (its memory per stage; DeepSpeed targets that fit)
# then the parameter count (generated/outputs/params.txt), and refills README.md's marked output
# blocks and summary table from these outputs (readme.py). Infeasible targets write no launch file;
# their outputs hold Piper's refusal. The search time and rate in the outputs vary from run to run;
# every other number is deterministic. tests/unit/test_recipe_files.py checks that the committed
# files equal what this produces.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
[[ -x $root/.venv/bin/python ]] && export PATH=$root/.venv/bin:$PATH
export PYTHONWARNINGS=ignore
unset MEGATRON_LM PIPER_PROFILE TOKENIZER_ARGS   # outputs must not depend on the caller's setup
cd "$here"

TARGETS=("dgx-h100 64" "dgx-h100 1024" "frontier 64" "frontier 256" "frontier 1024")
out=generated
rm -rf "$out"
mkdir -p "$out/megatron" "$out/deepspeed" "$out/outputs" "$out/figures"

for target in "${TARGETS[@]}"; do
  read -r cluster gpus <<< "$target"
  name=$cluster-$gpus
  echo "== $name"
  piper plan switch-1t --cluster "$cluster" --gpus "$gpus" --gbs 2048 --detail \
    --export-megatron "$out/megatron/$name.sh" --plot "$out/figures/$name" \
    > "$out/outputs/plan-$name.txt" || true          # exit 1: no plan fits (the output says why)
  ./megatron.sh "$cluster" "$gpus" --plan-only > "$out/outputs/megatron-$name.txt" 2>&1 || true
  python deepspeed_plan.py --cluster "$cluster" --gpus "$gpus" --out "$out/deepspeed/$name.json" 2>/dev/null \
    | grep -v '^\[.*real_accelerator' > "$out/outputs/deepspeed-$name.txt" || true
  rmdir "$out/figures/$name" 2>/dev/null || true    # no plot without a plan
  if [[ -f $out/deepspeed/$name.json ]]; then
    piper predict switch-1t --cluster "$cluster" --gpus "$gpus" --parallel "$(python deepspeed_plan.py --parallel "$out/deepspeed/$name.json")" \
      > "$out/outputs/predict-deepspeed-$name.txt"
  fi
done
python - > "$out/outputs/params.txt" <<'PY'
from piper_core.presets import load_model
from piper_core.resource.params import active_params, total_params
m = load_model("switch-1t")
print(f"switch-1t: {total_params(m):,} parameters (total_params), {active_params(m):,} active per token (active_params)")
PY
python readme.py                                    # refill README.md's output blocks and summary table
find "$out" -type f | sort
