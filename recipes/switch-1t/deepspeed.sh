#!/usr/bin/env bash
# DeepSpeed launch of the switch-1t recipe: Piper's training script with a "piper" block config
# (docs/deepspeed.md).
#
#   ./deepspeed.sh CLUSTER GPUS --plan-only       # any machine: the plan rank 0 will print
#   ./deepspeed.sh CLUSTER GPUS [train flags]     # once, on the launch host (DeepSpeed's launcher)
#
# CLUSTER: dgx-h100 | frontier; GPUS: 64 or 1024. The config is generated/deepspeed/CLUSTER-GPUS.json
# (written by deepspeed_plan.py, see regenerate.sh): the plan piper_deepspeed.initialize picks,
# pinned. Where no plan DeepSpeed can run fits (64 GPUs of either cluster; README.md says why)
# there is no config: the script prints the refusal and exits 1.
#
# Environment for a real launch: HOSTFILE (DeepSpeed hostfile, "host slots=8" per node), optional
# DS_LAUNCHER (pdsh, default; slurm, openmpi, ...), DATA (a text file; default synthetic data),
# STEPS (default 100).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ $# -lt 2 ]]; then
  sed -n '2,9p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
cluster=$1 gpus=$2
shift 2
config=$here/generated/deepspeed/$cluster-$gpus.json

if [[ ${1:-} == --plan-only || ! -f $config ]]; then
  [[ ${1:-} == --plan-only ]] || echo "deepspeed.sh: no DeepSpeed plan fits switch-1t on $gpus GPUs of $cluster (README.md):" >&2
  python "$here/deepspeed_plan.py" --cluster "$cluster" --gpus "$gpus" && status=0 || status=$?
  [[ ${1:-} == --plan-only ]] && exit "$status" || exit 1
fi

: "${HOSTFILE:?set HOSTFILE to a DeepSpeed hostfile with $((gpus / 8)) nodes of 8 slots}"
exec deepspeed --hostfile "$HOSTFILE" --launcher "${DS_LAUNCHER:-pdsh}" --num_nodes "$((gpus / 8))" --num_gpus 8 \
  --module piper_deepspeed.train --config "$config" --model switch-1t --steps "${STEPS:-100}" \
  ${DATA:+--data "$DATA"} "$@"
