#!/usr/bin/env bash
# Tree decoding against plain batched `generate` at batch sizes 1, 4 and 16 (docs/benchmarks.md, "Batches"): every
# drafter as shipped (tree_budget="auto" with the free candidates) and at the fixed budget 8 it shipped with before,
# the lookup tree as shipped ("auto") and at 16 nodes, MT-Bench and HumanEval, then the speed-up-vs-batch figure.
# Each run is resumable (out/batch/<dtype>-<dataset>-b<B>/per_prompt.jsonl).
#
#   bash examples/batch_sweep.sh [float32|bfloat16] [num_prompts] [max_new_tokens] [repeats] [methods]
# (batch 16 takes at least 16 prompts: one full batch; `repeats` rounds of every method per batch at B > 1, the
# median round kept: a batch's ratio there rests on 1-2 batches, and this shared machine's bursts move one call by 5%)
set -euo pipefail

DTYPE=${1:-float32}
PROMPTS=${2:-8}
TOKENS=${3:-48}
OUT=${OUT:-out/batch}
REPEATS=${4:-1}
METHODS=${5:-plain,prompt_lookup,lookup_tree@16,lookup_tree,eagle3@8,eagle3,specblock@8,specblock,dflash@8,dflash}

for dataset in mt_bench humaneval; do
    for batch in 1 4 16; do
        specblock-bench --target_model smollm2-135m-instruct --dtype "$DTYPE" --dataset "$dataset" \
            --num_prompts "$(( batch > PROMPTS ? batch : PROMPTS ))" --max_new_tokens "$TOKENS" --batch_size "$batch" --methods "$METHODS" \
            --repeats "$(( batch > 1 ? REPEATS : 1 ))" \
            --output_dir "$OUT/$DTYPE-$dataset-b$batch"
    done
done
python examples/plot_batch_sweep.py "$OUT" --dtype "$DTYPE"
