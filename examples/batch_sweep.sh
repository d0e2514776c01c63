#!/usr/bin/env bash
# Tree decoding against plain batched `generate` at batch sizes 1, 4 and 16 (docs/benchmarks.md, "Batches"): every
# method with the shipped fixed budget and with "auto", MT-Bench and HumanEval, then the speed-up-vs-batch figure.
# Each run is resumable (out/batch/<dtype>-<dataset>-b<B>/per_prompt.jsonl).
#
#   bash examples/batch_sweep.sh [float32|bfloat16] [num_prompts] [max_new_tokens]
# (batch 16 takes at least 16 prompts: one full batch)
set -euo pipefail

DTYPE=${1:-float32}
PROMPTS=${2:-8}
TOKENS=${3:-48}
OUT=${OUT:-out/batch}
METHODS=plain,prompt_lookup,lookup_tree,lookup_tree@auto,eagle3,eagle3@auto,specblock,specblock@auto,dflash,dflash@auto

for dataset in mt_bench humaneval; do
    for batch in 1 4 16; do
        specblock-bench --target_model smollm2-135m-instruct --dtype "$DTYPE" --dataset "$dataset" \
            --num_prompts "$(( batch > PROMPTS ? batch : PROMPTS ))" --max_new_tokens "$TOKENS" --batch_size "$batch" --methods "$METHODS" \
            --output_dir "$OUT/$DTYPE-$dataset-b$batch"
    done
done
python examples/plot_batch_sweep.py "$OUT" --dtype "$DTYPE"
