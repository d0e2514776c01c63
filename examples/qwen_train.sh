#!/bin/bash
# Issue 62, item 4: train one Qwen2.5-Coder-0.5B-Instruct drafter from the shared feature store (examples/qwen_data.sh)
# to a fixed CPU budget with the schedule every drafter of the comparison gets: warm-up, a stable phase and a linear
# decay over the last 20% of the budget (warmup_stable_decay, in CPU time), one thread, nice. Resumable: rerun the same
# command and it continues from its last checkpoint (the schedule follows the CPU time already spent).
#
#   examples/qwen_train.sh specblock 1.0 [extra specblock-train arguments]   # -> $QWEN_RUNS/specblock-1.0h
#   examples/qwen_train.sh eagle3 1.0
#
# Run it in the background: nohup examples/qwen_train.sh specblock 1.0 >> /work/qwen-runs/specblock.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
DRAFTER=$1 CPU_HOURS=$2
shift 2
DATA=${QWEN_DATA:-/work/qwen-data/qwen2.5-coder-0.5b-instruct}
OUT=${QWEN_RUNS:-/work/qwen-runs}/$DRAFTER-${CPU_HOURS}h${RUN_SUFFIX:-}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
case $DRAFTER in
  specblock) ARCH=(--drafter_num_layers "${LAYERS:-1}" --fusion_identity_init) ;;
  eagle3) ARCH=() ;;
  *) echo "drafter must be specblock or eagle3, got $DRAFTER" >&2; exit 2 ;;
esac
exec nice -n 10 .venv/bin/specblock-train --drafter "$DRAFTER" "${ARCH[@]}" \
  --target_model qwen2.5-coder-0.5b-instruct --dtype bfloat16 --bf16 --use_cpu \
  --feature_store "$DATA/features/train" --eval_dataset none --max_length 1024 \
  --draft_vocab_size 16384 --per_device_train_batch_size 1 --max_steps 1000000 \
  --learning_rate 3e-4 --warmup_steps 20 --lr_scheduler_type warmup_stable_decay --decay_share 0.2 \
  --max_train_cpu_hours "$CPU_HOURS" --seed "${SEED:-0}" \
  --logging_steps 5 --save_strategy steps --save_steps 20 --save_total_limit 2 --resume_from_checkpoint last \
  --save_dtype bfloat16 --license apache-2.0 --report_to none --dataloader_num_workers 0 \
  --output_dir "$OUT" "$@"
