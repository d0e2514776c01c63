#!/usr/bin/env bash
# Short A/Bs at equal training tokens: which answers a drafter should learn from (the target's own, regenerated, or
# ShareGPT's), and recipe changes on ShareGPT's answers.
#
#   examples/data_ab.sh [ROOT] [TOKENS] [ARMS]   (defaults: /work/campaign/ab 150000 regenerated,sharegpt; NICE=19)
#
# Arms (new SpecBlock drafters with the campaign recipe: K 4, 2 blocks, slot-0 normalisation, identity fusion,
# cosine, lr 7e-4, batch 2, bfloat16 autocast, seed 0):
#   regenerated  on the 3,456 answers the target wrote (greedy, kept compressed in docs/results/gpu-h200-2026-11-30/)
#   sharegpt     on ShareGPT's own answers (train split)
#   head-start   sharegpt, its decoder layers started from the target's top layers (--init_decoder_from_target)
#   one-layer    sharegpt, one decoder layer instead of two (--drafter_num_layers 1)
#   lr-RATE      sharegpt at peak learning rate RATE instead of 7e-4 (lr-3e-4, lr-2e-3)
#   batch-N      sharegpt, N conversations per step instead of 2 (fewer steps for the same tokens)
#   k-N          sharegpt, blocks of N slots instead of 4 (--block_size N)
#   blocks-N     sharegpt, N blocks per training step instead of 2 (--num_blocks N; the reference trains 3)
# Each trains for about TOKENS training tokens (its step count from its data's mean conversation length and its batch),
# evaluating every 25 steps (a twentieth of the run when that is longer) on the ShareGPT held-out split, and resumes where it
# stopped. Compare the curves against tokens:
#   python examples/plot_learning_curves.py ROOT/regenerated ROOT/sharegpt --x tokens
# then tau on MT-Bench / HumanEval with examples/evaluate_drafter.py. The arms run side by side, one thread each,
# under `nice -n NICE`.
# Caveat: the held-out set holds ShareGPT's answers, the ShareGPT arms' own kind of text; tau decides.
set -euo pipefail
ROOT=${1:-/work/campaign/ab}
TOKENS=${2:-150000}
ARMS=${3:-regenerated,sharegpt}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
NICE=${NICE:-19}
export PYTHONPATH=$REPO/src OMP_NUM_THREADS=1

for ARM in ${ARMS//,/ }; do
  case $ARM in
    regenerated) DATA=regenerated EXTRA=() ;;
    sharegpt) DATA=sharegpt EXTRA=() ;;
    head-start) DATA=sharegpt EXTRA=(--init_decoder_from_target) ;;
    one-layer) DATA=sharegpt EXTRA=(--drafter_num_layers 1) ;;
    lr-* | batch-* | k-* | blocks-*) DATA=sharegpt EXTRA=() ;;
    *) echo "unknown arm $ARM (regenerated, sharegpt, head-start, one-layer, lr-RATE, batch-N, k-N, blocks-N)" >&2
       exit 2 ;;
  esac
  LEARNING_RATE=7e-4 BATCH=2 BLOCK_SIZE=4 NUM_BLOCKS=2
  case $ARM in
    lr-*) LEARNING_RATE=${ARM#lr-} ;;
    batch-*) BATCH=${ARM#batch-} ;;
    k-*) BLOCK_SIZE=${ARM#k-} ;;
    blocks-*) NUM_BLOCKS=${ARM#blocks-} ;;
  esac
  if [ ! -f "$ROOT/data-$DATA/train.jsonl" ]; then
    case $DATA in
      regenerated) SOURCES=(--no_sharegpt_answers) ;;
      sharegpt) SOURCES=(--gpu_answers '') ;;
    esac
    nice -n "$NICE" "$PYTHON" "$REPO/examples/campaign_data.py" --output_dir "$ROOT/data-$DATA" "${SOURCES[@]}"
  fi
  STEPS=$("$PYTHON" -c "import json, sys; t = json.load(open(sys.argv[1]))['total']; \
print(round(int(sys.argv[2]) / (int(sys.argv[3]) * t['tokens'] / t['conversations'])))" \
    "$ROOT/data-$DATA/stats.json" "$TOKENS" "$BATCH")
  nice -n "$NICE" "$PYTHON" -m transformers_specblock.train --target_model smollm2-135m-instruct \
    --dataset "$ROOT/data-$DATA/train.jsonl" --eval_dataset sharegpt-heldout --eval_samples 64 --draft_vocab_size 8192 \
    --max_length 512 --per_device_train_batch_size "$BATCH" --learning_rate "$LEARNING_RATE" --lr_scheduler_type cosine \
    --warmup_steps $((STEPS / 10)) --max_steps "$STEPS" --save_steps 10 --save_total_limit 2 --logging_steps 5 \
    --eval_strategy steps --eval_steps $((STEPS / 20 > 25 ? STEPS / 20 : 25)) --save_dtype bfloat16 \
    --features online --dtype bfloat16 --bf16 \
    --seed 0 --report_to none --dataloader_num_workers 0 --use_cpu --block_size "$BLOCK_SIZE" --num_blocks "$NUM_BLOCKS" \
    --slot_normalization slot0 --fusion_identity_init "${EXTRA[@]}" --resume_from_checkpoint last \
    --output_dir "$ROOT/$ARM" > "$ROOT/$ARM.log" 2>&1 &
done
wait
