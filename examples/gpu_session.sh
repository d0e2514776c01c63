#!/usr/bin/env bash
# One prepared GPU session (<= 9 minutes on one H200-class GPU, no network): (b) the three SmolLM2 drafters trained
# side by side for the same GPU minutes (examples/gpu_train_drafters.sh), then (a) every decoding method benchmarked
# in bfloat16 with its aten-op / host-sync counts per iteration (--count_ops), with the shipped (CPU-trained) drafters
# and the GPU-trained ones (wall clock around a device sync: what CUDA events would measure for a whole call).
#
#   examples/gpu_session.sh full  BUNDLE WORK OUT [TRAIN_MINUTES] [SECONDS]  # on the GPU machine (SECONDS: 530)
#   examples/gpu_session.sh smoke BUNDLE WORK OUT [TRAIN_MINUTES] [SECONDS]  # anywhere (an idle CPU: a few minutes)
#   examples/gpu_session.sh bundle BUNDLE                           # here, with the assets installed: write BUNDLE
#
# BUNDLE is gpu_train_drafters.sh's (SmolLM2 GGUF pieces, tokenizer, ShareGPT) plus the prompt sets this script reads
# (prompts/*.jsonl). A device call carries at most 64 MiB with the working tree, which the shipped drafters nearly
# fill: bring the bundle (and any wheels) in pieces over earlier calls of the same lease, then run this once. The
# Qwen2.5-Coder-1.5B / 0.5B pair (over 1 GB) runs only where BUNDLE holds qwen2.5-coder-1.5b-instruct/ and
# qwen2.5-coder-0.5b-instruct/ as model folders. Batch 4 runs where `specblock-bench` takes --batch_size.
# Everything lands in OUT: bench-*/ (results.json, results.md with the op / sync table), train/ (the drafters,
# their logs and learning curves), session.log with the timings of every step.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
if [ "$1" = bundle ]; then
  PYTHON=$PY bash "$REPO/examples/gpu_train_drafters.sh" bundle "$2"
  mkdir -p "$2/prompts"
  $PY - "$2/prompts" <<'EOF'
import json, sys
from transformers_specblock.hub.prompts import load_prompts
for name in ("mt_bench", "humaneval"):
    with open(f"{sys.argv[1]}/{name}.jsonl", "w") as out:
        for row in load_prompts(name):
            out.write(json.dumps({key: row[key] for key in ("id", "category", "prompt")}) + "\n")
EOF
  exit 0
fi
MODE=$1 BUNDLE=$(realpath "$2") WORK=$(mkdir -p "$3" && realpath "$3") OUT=$(mkdir -p "$4" && realpath "$4")
TRAIN_MINUTES=${5:-1.5} LIMIT=${6:-530}  # the whole session's seconds (9 minutes less a margin)
export XDG_CACHE_HOME=$WORK/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
LOG=$OUT/session.log START=$(date +%s)
step() { echo "== $(date -u +%T) +$(($(date +%s) - START))s $*" | tee -a "$LOG"; }
bench() {  # run name, seconds at most (cut to what is left), then specblock-bench arguments
  local name=$1 cap=$2 left=$((LIMIT - $(date +%s) + START)); shift 2
  [ "$left" -lt "$cap" ] && cap=$left
  [ "$cap" -lt 20 ] && { step "bench $name skipped: the session's time is spent"; return; }
  step "bench $name (at most $cap s)"
  timeout "$cap" $PY -c "from transformers_specblock.commands.cli import bench_main; bench_main()" \
    --device "$DEVICE" --no_near_ties --count_ops --output_dir "$OUT/bench-$name" "$@" > "$OUT/bench-$name.log" 2>&1 \
    && grep -A12 "aten ops and host syncs" "$OUT/bench-$name/results.md" | tee -a "$LOG" \
    || echo "bench $name FAILED or timed out (see bench-$name.log)" | tee -a "$LOG"
}
step "mode $MODE on $DEVICE: $($PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
if [ "$MODE" = smoke ]; then
  PROMPTS=1 TOKENS=12 WARMUP=4 CAP=$((LIMIT / 4))
  TRAIN=(smoke "$BUNDLE" "$WORK/train" "$OUT/train")
  TARGET=$WORK/train/random-smollm2
else
  PROMPTS=4 TOKENS=96 WARMUP=16 CAP=100
  TRAIN=(full "$BUNDLE" "$WORK/train" "$OUT/train" "$TRAIN_MINUTES" 45)
  TARGET=$WORK/train/cache/transformers_specblock/models/smollm2-135m-instruct
fi

# (b) the three SmolLM2 drafters side by side for the same GPU minutes (converts the target first)
BUDGET=$([ "$MODE" = smoke ] && echo "its smoke budgets" || echo "$TRAIN_MINUTES min each")
step "training specblock, eagle3, dflash side by side (gpu_train_drafters.sh ${TRAIN[0]}: $BUDGET)"
PYTHON=$PY OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} bash "$REPO/examples/gpu_train_drafters.sh" "${TRAIN[@]}" \
  > "$OUT/train.log" 2>&1 || step "training FAILED (see train.log)"
grep -E "^== |done|FAILED" "$OUT/train.log" | tee -a "$LOG" || true

# (a) every method on SmolLM2-135M in bfloat16, the shipped (CPU-trained) drafters, then the GPU-trained ones
SHIPPED=(--specblock_model specblock-smollm2-135m-instruct --eagle3_model eagle3-smollm2-135m-instruct
  --dflash_model dflash-smollm2-135m-instruct)
COMMON=(--target_model "$TARGET" --dtype bfloat16 --max_new_tokens "$TOKENS" --num_prompts "$PROMPTS"
  --warmup_tokens "$WARMUP")
MT=(--dataset "$BUNDLE/prompts/mt_bench.jsonl") HE=(--dataset "$BUNDLE/prompts/humaneval.jsonl")
bench smollm2-mt_bench "$CAP" "${COMMON[@]}" "${SHIPPED[@]}" "${MT[@]}" \
  --methods plain,prompt_lookup,lookup_tree,eagle3,specblock,dflash,dflash_chain
TRAINED=()
for kind in specblock eagle3 dflash; do
  [ -f "$OUT/train/$kind/config.json" ] && TRAINED+=("--${kind}_model" "$OUT/train/$kind")
done
if [ ${#TRAINED[@]} -eq 6 ]; then
  bench trained-mt_bench "$CAP" "${COMMON[@]}" "${TRAINED[@]}" "${MT[@]}" --methods plain,eagle3,specblock,dflash
else
  step "not every drafter finished training: no benchmark of the GPU-trained drafters (see train.log)"
fi
bench smollm2-humaneval "$CAP" "${COMMON[@]}" "${SHIPPED[@]}" "${HE[@]}" \
  --methods plain,prompt_lookup,lookup_tree,eagle3,specblock,dflash
if $PY -c "from transformers_specblock.commands.cli import bench_main; bench_main()" --help 2>/dev/null \
    | grep -q -- --batch_size; then
  bench smollm2-mt_bench-batch4 "$CAP" "${COMMON[@]}" "${SHIPPED[@]}" "${MT[@]}" --methods plain,eagle3,specblock \
    --batch_size 4
else
  step "batch 4 skipped: specblock-bench has no --batch_size yet"
fi
if [ -d "$BUNDLE/qwen2.5-coder-1.5b-instruct" ] && [ -d "$BUNDLE/qwen2.5-coder-0.5b-instruct" ]; then
  bench qwen-humaneval "$CAP" --target_model "$BUNDLE/qwen2.5-coder-1.5b-instruct" --dtype bfloat16 \
    --max_new_tokens "$TOKENS" --num_prompts "$PROMPTS" "${HE[@]}" \
    --assistant_model "$BUNDLE/qwen2.5-coder-0.5b-instruct" --methods plain,prompt_lookup,assisted,lookup_tree
else
  step "Qwen2.5-Coder-1.5B skipped: BUNDLE holds no qwen2.5-coder-1.5b-instruct/ and -0.5b-instruct/ folders"
fi
step "done"
