#!/usr/bin/env bash
# Megatron-LM launch of the switch-1t recipe through Piper's launcher (docs/megatron.md).
#
#   ./megatron.sh CLUSTER GPUS --plan-only        # any machine: what rank 0 will print, nothing built
#   ./megatron.sh CLUSTER GPUS [extra Megatron flags]   # on every node of the job (torchrun)
#
# CLUSTER: dgx-h100 | frontier (Piper cluster presets); GPUS: the world size (64, 256 or 1024).
# `python -m piper_megatron pretrain_gpt.py <model> --piper` plans at launch (the plan README.md
# shows; with PIPER_PROFILE=PROFILE.yaml from `piper calibrate`, from the measured efficiencies).
# Where no plan fits (frontier 64) the script prints Piper's refusal and exits 1.
# STOCK=1: stock Megatron-LM without Piper, with the plan in generated/megatron/CLUSTER-GPUS.sh
# (`piper plan --export-megatron`, see regenerate.sh).
#
# Environment for a real launch: MEGATRON_LM (a Megatron-LM checkout, core_v0.16-0.19),
# DATA_PATH (Megatron indexed dataset prefix), NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT (as for
# torchrun; NNODES defaults to GPUS / 8), optional TOKENIZER_ARGS, CHECKPOINT_DIR, PIPER_PROFILE.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ $# -lt 2 ]]; then
  sed -n '2,11p' "${BASH_SOURCE[0]}" >&2
  exit 2
fi
cluster=$1 gpus=$2
shift 2
plan_only=0
if [[ ${1:-} == --plan-only ]]; then plan_only=1; shift; fi

# The model: the switch-1t preset as Megatron flags, exactly what piper_core.export.model_flags
# writes for it (tests/unit/test_recipe_files.py checks), with the recipe's batch and precision.
MODEL_ARGS=(
  --num-layers 24
  --hidden-size 4096
  --num-attention-heads 64
  --ffn-hidden-size 10240
  --seq-length 2048
  --max-position-embeddings 2048
  --make-vocab-size-divisible-by 128
  --position-embedding-type rope
  --normalization RMSNorm
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --untie-embeddings-and-output-weights
  --disable-bias-linear
  --num-experts 512
  --moe-ffn-hidden-size 10240
  --moe-router-topk 1
  --moe-layer-freq 1
  --moe-token-dispatcher-type alltoall
  --moe-router-pre-softmax      # Megatron refuses top-1 with a post-top-k softmax (Switch: softmax, then top-1)
  --moe-expert-capacity-factor 1.25
  --global-batch-size 2048
  --bf16
)
# Data and tokenizer: a 32,128-token vocabulary as T5's (Piper needs --vocab-size to count the
# embedding; NullTokenizer reads pre-tokenized data). Replace with your tokenizer's flags.
read -r -a TOKENIZER <<< "${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 32128}"
# Optimizer and schedule: Switch Transformer's load-balancing loss (alpha = 0.01, Fedus et al.
# 2101.03961 Sec. 2.2); the rest are common Megatron GPT settings, not tuned for this model.
TRAINING_ARGS=(
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.01
  --lr 1.0e-4 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 2000 --train-iters 100000
  --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
  --split 969,30,1 --log-interval 10 --eval-interval 1000 --eval-iters 10 --save-interval 1000
)

script=${MEGATRON_LM:+$MEGATRON_LM/}pretrain_gpt.py
if [[ ${STOCK:-0} == 1 ]]; then
  # Stock Megatron-LM, without Piper's launcher: the plan `piper plan --export-megatron` wrote
  # (Megatron's own token dispatcher; this plan may use expert tensor parallelism).
  args_file=$here/generated/megatron/$cluster-$gpus.sh
  [[ -f $args_file ]] || { echo "megatron.sh: no plan fits switch-1t on $gpus GPUs of $cluster (README.md)" >&2; exit 1; }
  # shellcheck source=/dev/null
  source "$args_file"                             # PIPER_MEGATRON_ARGS (model + plan) and environment
  ARGS=("${PIPER_MEGATRON_ARGS[@]}") PIPER=() LAUNCH=("$script")
else
  # Piper's launcher plans at launch (deterministic: the plan --plan-only prints) and runs Piper's
  # all-to-all; with PIPER_PROFILE, from the calibrated profile.
  ARGS=("${MODEL_ARGS[@]}") LAUNCH=(-m piper_megatron "$script")
  PIPER=(--piper --piper-cluster "$cluster" ${PIPER_PROFILE:+--piper-profile "$PIPER_PROFILE"})
  python -m piper_megatron "$script" "${ARGS[@]}" "${TOKENIZER[@]}" "${PIPER[@]}" \
    --piper-plan-only --piper-world-size "$gpus" > /dev/null 2>&1 || plan_only=1   # no plan fits: show why
fi

if [[ $plan_only == 1 ]]; then
  python -m piper_megatron "$script" "${ARGS[@]}" "${TOKENIZER[@]}" "${PIPER[@]}" \
    --piper-plan-only --piper-world-size "$gpus"
  exit
fi

: "${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout (the directory of pretrain_gpt.py)}"
: "${DATA_PATH:?set DATA_PATH to the Megatron indexed dataset prefix}"
: "${MASTER_ADDR:?set MASTER_ADDR (the rendezvous host) as for torchrun}"
per_node=8                                        # dgx-h100: 8 H100; frontier: 8 MI250X GCDs
checkpoints=${CHECKPOINT_DIR:-checkpoints/switch-1t-$cluster-$gpus}
exec torchrun --nnodes "${NNODES:-$((gpus / per_node))}" --nproc-per-node "$per_node" \
  --node-rank "${NODE_RANK:?set NODE_RANK}" --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  "${LAUNCH[@]}" "${ARGS[@]}" "${TOKENIZER[@]}" "${TRAINING_ARGS[@]}" \
  --data-path "$DATA_PATH" --save "$checkpoints" --load "$checkpoints" "${PIPER[@]}" "$@"
