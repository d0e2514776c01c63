"""In the dflash venv: z-lab's `dflash_generate` (their batch-1 chain loop: each target call verifies the whole
block) against plain greedy `generate`, interleaved per prompt on one thread; target forwards counted by a hook
(prefill included), wall time per call of each."""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from dflash.model import DFlashDraftModel, dflash_generate

args = json.loads(sys.argv[1])
torch.set_num_threads(1)
dtype = getattr(torch, args["dtype"])
target = AutoModelForCausalLM.from_pretrained(args["target"], dtype=dtype).eval()
drafter = DFlashDraftModel.from_pretrained(args["drafter"], dtype=dtype).eval()
calls = []
target.register_forward_pre_hook(lambda module, inputs: calls.append(1))
stop = args["stop_token_ids"]
rows = []
for prompt in args["prompts"]:
    ids = torch.tensor([prompt])
    row = {}
    for method in ("plain", "reference_chain"):
        calls.clear()
        start = time.perf_counter()
        with torch.inference_mode():
            if method == "plain":
                out = target.generate(ids, do_sample=False, max_new_tokens=args["max_new_tokens"])
            else:
                out = dflash_generate(drafter, target, ids, args["max_new_tokens"], stop)
        seconds = time.perf_counter() - start
        row[method] = {"seconds": seconds, "target_calls": len(calls), "output": out[0, ids.shape[1]:].tolist()}
    rows.append(row)
print(json.dumps({"rows": rows, "block_size": drafter.block_size, "target_layer_ids": drafter.target_layer_ids}))
