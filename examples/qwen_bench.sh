#!/bin/bash
# Issue 62, items 6-7: Qwen2.5-Coder-0.5B-Instruct in bfloat16, every method interleaved per prompt, from an empty
# cache folder (the converted model linked in): plain, the A/A control, transformers' prompt lookup, the lookup tree,
# EAGLE-3 (3 and 6 levels deep) and SpecBlock with 1, 2 and 3 block rounds, each drafter as shipped otherwise;
# HumanEval and MT-Bench side by side, one thread each. Resumable (finished prompts are kept in OUT/<set>/per_prompt.jsonl).
#
#   examples/qwen_bench.sh OUT [SPECBLOCK_DRAFTER] [EAGLE3_DRAFTER]     # default: the shipped drafters
#   NUM_PROMPTS=16 MAX_NEW_TOKENS=128 (defaults) set the size of each set.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1 TARGET=qwen2.5-coder-0.5b-instruct
DRAFTERS=(${2:+--specblock_model "$2"} ${3:+--eagle3_model "$3"})
MODELS=${XDG_CACHE_HOME:-$HOME/.cache}/transformers_specblock/models
mkdir -p "$OUT"
METHODS=plain,plain_control,prompt_lookup,lookup_tree,eagle3,eagle3_depth6,specblock_one_block,specblock_two_blocks,specblock_three_blocks
for dataset in humaneval mt_bench; do
  CACHE=$(mktemp -d)  # one empty cache folder per set: nothing persisted by one run reaches the other
  mkdir -p "$CACHE/transformers_specblock/models" && ln -s "$MODELS/$TARGET" "$CACHE/transformers_specblock/models/"
  XDG_CACHE_HOME=$CACHE OMP_NUM_THREADS=1 .venv/bin/specblock-bench --target_model "$TARGET" --dtype bfloat16 \
    --methods "$METHODS" "${DRAFTERS[@]}" --dataset "$dataset" --num_prompts "${NUM_PROMPTS:-16}" \
    --max_new_tokens "${MAX_NEW_TOKENS:-128}" --output_dir "$OUT/bfloat16-$dataset" > "$OUT/bfloat16-$dataset.log" 2>&1 &
done
wait
