#!/bin/bash
# Issue 62, items 2-3: the Qwen2.5-Coder-0.5B-Instruct training data (ShareGPT, Python sources, the target's own
# answers; train / select / report splits, benchmark-decontaminated) and its target features (bfloat16, sharded),
# built by one resumable command: rerun this script to continue where it stopped (each stage resumes from disk).
# Everything goes to $QWEN_DATA (default /work/qwen-data/qwen2.5-coder-0.5b-instruct), outside git.
# Run it in the background: nohup examples/qwen_data.sh >> /work/qwen-data/pipeline.log 2>&1 &
# Extra arguments go to the command, e.g. --stages features (skip the regeneration minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false
exec nice -n 10 .venv/bin/python -m transformers_specblock.commands.build_data \
  --target_model qwen2.5-coder-0.5b-instruct \
  --output_dir "${QWEN_DATA:-/work/qwen-data/qwen2.5-coder-0.5b-instruct}" \
  --threads 1 --regenerate_minutes "${REGENERATE_MINUTES:-15}" --select_feature_tokens 65536 \
  --max_feature_tokens 4000000 "$@"
