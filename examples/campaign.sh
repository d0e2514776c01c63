#!/usr/bin/env bash
# The drafter training campaign: start it, or continue it where it stopped, in the background.
#
#   examples/campaign.sh [specblock|eagle3] [CAMPAIGN_DIR]        (defaults: specblock /work/campaign)
#
# One training process, one thread, `nice -n 19`, its log in CAMPAIGN_DIR/DRAFTER/train.log (tqdm progress); bfloat16
# where the CPU has it natively, float32 elsewhere.
# Where it starts from, in this order:
#   1. the newest COMPLETE checkpoint of the run started last (CAMPAIGN_DIR/DRAFTER-from-step-N with the largest N,
#      else CAMPAIGN_DIR/DRAFTER; `--resume_from_checkpoint last`: a checkpoint every SAVE_STEPS steps, a few minutes;
#      one whose save was interrupted is passed over), same schedule and data order;
#   2. else the campaign's last committed weights, docs/results/campaign/DRAFTER/ (when a machine lost its files):
#      a new run from them with a short warm-up (WARMUP_AFTER_LOSS steps) to the learning rate the schedule had
#      reached there, decaying to 0 over the steps left, and a data order of its
#      own (--data_seed = the committed step: seed 0's order would replay the conversations already trained on),
#      recorded in docs/results/campaign/starts.jsonl and in the run's own records (its command names --init_drafter);
#   3. else the shipped drafter (the first start).
# DRY_RUN=1 prints the command instead. The data (CAMPAIGN_DIR/data/train.jsonl) is built first if missing: examples/campaign_data.py.
# Afterwards, `python examples/campaign_curve.py DRAFTER CAMPAIGN_DIR` appends the new held-out evaluations to
# docs/results/campaign/DRAFTER.jsonl (commit it), and with --weights copies the drafter's weights there.
set -euo pipefail

DRAFTER=${1:-specblock}
ROOT=${2:-/work/campaign}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
DATA=$ROOT/data/train.jsonl
MAX_STEPS=${MAX_STEPS:-7000}           # x 2 conversations x ~440 tokens = about 6.1M training tokens (45% held-out slot-0 asks for about 6.4M in all)
SAVE_STEPS=${SAVE_STEPS:-10}           # SpecBlock: 10 steps = 3-5 minutes on one shared core
WARMUP_AFTER_LOSS=${WARMUP_AFTER_LOSS:-20}
LEARNING_RATE=${LEARNING_RATE:-2e-4}      # peak; 7e-4 (the shipped runs') lowered held-out accuracy when continued
COMMITTED=$REPO/docs/results/campaign/$DRAFTER

case $DRAFTER in
  specblock) RECIPE=(--block_size 4 --num_blocks 2 --slot_normalization slot0 --fusion_identity_init) ;;
  eagle3) RECIPE=(--drafter eagle3) ;;
  *) echo "usage: $0 [specblock|eagle3] [CAMPAIGN_DIR]" >&2; exit 2 ;;
esac

if pgrep -f -- "--output_dir $ROOT/$DRAFTER(-from-step-[0-9]+)?( |$)" > /dev/null; then
  echo "a campaign run of $DRAFTER is already running (under $ROOT)" >&2
  exit 1
fi
OUT=$ROOT/$DRAFTER  # the run started last: the one a resume continues
for RUN in "$ROOT/$DRAFTER"-from-step-*; do
  if [ -d "$RUN" ] && { [ "$OUT" = "$ROOT/$DRAFTER" ] || [ "${RUN##*-from-step-}" -gt "${OUT##*-from-step-}" ]; }; then
    OUT=$RUN
  fi
done
if [ ! -f "$DATA" ]; then
  PYTHONPATH=$REPO/src OMP_NUM_THREADS=1 nice -n 19 "$PYTHON" "$REPO/examples/campaign_data.py" --output_dir "$ROOT/data"
fi

# bfloat16 (target in bfloat16, drafter under bf16 autocast) where the CPU multiplies it natively (AVX512-BF16, AMX):
# 1.3-2.2x float32; where it is emulated (AVX2 only) it is 10-20x slower, and the run trains in float32
if PYTHONPATH=$REPO/src "$PYTHON" -c "import sys; from transformers_specblock.hub.provenance import \
native_bfloat16_flags as native; sys.exit(not native())"; then
  PRECISION=(--dtype bfloat16 --bf16)
else
  PRECISION=(--dtype float32)
fi
COMMON=(--target_model smollm2-135m-instruct --dataset "$DATA" --eval_dataset sharegpt-heldout --eval_samples 64
  --max_length 512 --per_device_train_batch_size 2 --learning_rate "$LEARNING_RATE" --lr_scheduler_type cosine
  --max_steps "$MAX_STEPS" --save_steps "$SAVE_STEPS" --save_total_limit 2 --logging_steps 5 --eval_strategy steps
  --eval_steps 50 --save_dtype bfloat16 --features online "${PRECISION[@]}" --seed 0 --report_to none
  --dataloader_num_workers 0 --use_cpu)

# A new run starts from a frozen copy of its drafter (OUT/start_drafter, named in OUT/init_drafter): a resume rebuilds
# the run from it, so its config and training record stay those of the drafter the run started from, whatever ships
# or is committed later.
freeze_start() {
  [ -n "${DRY_RUN:-}" ] && return
  PYTHONPATH=$REPO/src "$PYTHON" -c "import shutil, sys; from transformers_specblock.hub.shipped import \
resolve_drafter_path as path; shutil.copytree(path(sys.argv[1]), sys.argv[2], dirs_exist_ok=True)" "$1" "$OUT/start_drafter"
  echo "$OUT/start_drafter" > "$OUT/init_drafter"
}

# The schedule and data order of a run started from the committed weights at campaign step $1 (set in FROM_STEP):
# a short warm-up to the learning rate the campaign's schedule (cosine after 100 warm-up steps) had reached there,
# decaying to 0 at MAX_STEPS, instead of re-warming to the peak (which cost held-out accuracy); its own data order.
# A resume of that run passes the same, or its schedule and data order would change under it.
from_step_schedule() {
  LR_NOW=$("$PYTHON" -c "import math, sys; lr, done, total = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]); \
print(f'{lr * 0.5 * (1 + math.cos(math.pi * min(1, (done - 100) / (total - 100)))):.3e}')" \
    "$LEARNING_RATE" "$1" "$MAX_STEPS")
  FROM_STEP=(--warmup_steps "$WARMUP_AFTER_LOSS" --max_steps $(($MAX_STEPS - $1)) --learning_rate "$LR_NOW"
    --data_seed "$1")
}

if PYTHONPATH=$REPO/src "$PYTHON" -c "import sys; from transformers_specblock.training.trainer import \
last_complete_checkpoint as last; sys.exit(last(sys.argv[1]) is None)" "$OUT"; then
  INIT=$(cat "$OUT/init_drafter")  # the run is rebuilt as it started, then the checkpoint's weights load
  START=(--init_drafter "$INIT" --resume_from_checkpoint last --warmup_steps 100)
  if [[ $OUT =~ -from-step-([0-9]+)$ ]]; then
    from_step_schedule "${BASH_REMATCH[1]}"
    START+=("${FROM_STEP[@]}")
  fi
  HOW="resumed from its newest complete checkpoint"
elif [ -f "$COMMITTED/config.json" ]; then
  DONE=$(PYTHONPATH=$REPO/src "$PYTHON" -c "import json, sys; print(json.load(open(sys.argv[1]))['campaign_steps'])" \
    "$COMMITTED/campaign.json")
  OUT=$ROOT/$DRAFTER-from-step-$DONE
  [ -n "${DRY_RUN:-}" ] || mkdir -p "$OUT"
  freeze_start "$COMMITTED"
  from_step_schedule "$DONE"
  START=(--init_drafter "$OUT/start_drafter" "${FROM_STEP[@]}" --resume_from_checkpoint last)
  HOW="no checkpoint: from the committed weights (campaign step $DONE) with $WARMUP_AFTER_LOSS warm-up steps to lr $LR_NOW"
else
  freeze_start "$DRAFTER-smollm2-135m-instruct"
  START=(--init_drafter "$OUT/start_drafter" --resume_from_checkpoint last --warmup_steps 100)
  HOW="first start, from the shipped drafter"
fi

if [ -n "${DRY_RUN:-}" ]; then  # print what would run, start nothing
  echo "$HOW:" "$PYTHON" -m transformers_specblock.train "${COMMON[@]}" "${RECIPE[@]}" "${START[@]}" --output_dir "$OUT"
  exit 0
fi
mkdir -p "$REPO/docs/results/campaign"
echo "{\"date\": \"$(date -u +%FT%TZ)\", \"drafter\": \"$DRAFTER\", \"output_dir\": \"$OUT\", \"start\": \"$HOW\", \"precision\": \"${PRECISION[*]}\"}" \
  >> "$REPO/docs/results/campaign/starts.jsonl"
cd "$REPO"
PYTHONPATH=$REPO/src OMP_NUM_THREADS=1 nohup nice -n 19 "$PYTHON" -m transformers_specblock.train \
  "${COMMON[@]}" "${RECIPE[@]}" "${START[@]}" --output_dir "$OUT" >> "$OUT/train.log" 2>&1 &
echo "$DRAFTER: $HOW; pid $!, log $OUT/train.log"
