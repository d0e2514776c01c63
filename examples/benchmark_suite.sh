#!/usr/bin/env bash
# The benchmark runs published in docs/benchmarks.md, in order. Each run is resumable: rerun the script and the
# finished prompts of an interrupted run are kept (out/bench/<run>/per_prompt.jsonl). Results land in
# out/bench/<run>/{results.json,results.md,speedup_tau.png,time_per_iteration.png}.
#
#   bash examples/benchmark_suite.sh                # SmolLM2-135M-Instruct runs (about 80 minutes on 2 CPU cores)
#   bash examples/benchmark_suite.sh qwen           # + Qwen2.5-Coder-1.5B with assisted generation (make qwen-models)
set -euo pipefail

OUT=${OUT:-out/bench}
SMOL="--target_model smollm2-135m-instruct --num_prompts 8 --max_new_tokens 128"
ALL=plain,prompt_lookup,eagle3,specblock,specblock_fixed_tree,specblock_one_block

for dataset in mt_bench humaneval sharegpt; do
    specblock-bench $SMOL --dataset "$dataset" --methods "$ALL" --output_dir "$OUT/smollm2-$dataset-greedy"
done
specblock-bench $SMOL --dataset mt_bench --methods plain,eagle3,specblock --do_sample --temperature 1.0 \
    --output_dir "$OUT/smollm2-mt_bench-sample"
specblock-bench $SMOL --dataset mt_bench \
    --methods plain,specblock@2,specblock@4,specblock@8,specblock@16,specblock@32,specblock@auto,eagle3@auto \
    --output_dir "$OUT/smollm2-mt_bench-budgets"

# The drafters side by side at equal training compute: prompt lookup, EAGLE-3, SpecBlock, and DFlash both as our tree
# (its shipped budget 8, like the others, and "auto") and as transformers' own speculation_type="dflash" chain.
FOUR=plain,prompt_lookup,eagle3,specblock,specblock_one_block,dflash,dflash@auto,dflash_chain
for dataset in mt_bench humaneval; do
    specblock-bench $SMOL --dataset "$dataset" --methods "$FOUR" --output_dir "$OUT/smollm2-$dataset-four"
done

# Free candidates (prompt lookup / n-gram cache in the tree), both dtypes: float32 is the exactness reference, and
# bfloat16 pays only on a CPU that multiplies it natively (AVX512-BF16 / AMX; the results record the CPU's flags).
FREE=plain,prompt_lookup,lookup_tree,eagle3,eagle3+lookup,specblock,specblock+lookup
for dtype in float32 bfloat16; do
    for dataset in mt_bench humaneval sharegpt; do
        specblock-bench --target_model smollm2-135m-instruct --dtype "$dtype" --dataset "$dataset" --num_prompts 4 \
            --max_new_tokens 128 --methods "$FREE" --tree_budget auto --output_dir "$OUT/free-$dtype-$dataset"
    done
done

if [[ "${1:-}" == "qwen" ]]; then
    specblock-bench --target_model qwen2.5-coder-1.5b-instruct --assistant_model qwen2.5-coder-0.5b-instruct \
        --dataset humaneval --num_prompts 3 --max_new_tokens 64 --warmup_tokens 8 \
        --methods plain,prompt_lookup,assisted --output_dir "$OUT/qwen-1.5b-humaneval-greedy"
fi
