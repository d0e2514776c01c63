"""Tau of the shipped SpecBlock (best first, drafter alone, float32 greedy) by off_chain_penalty on held-out ShareGPT
prompts 9-20 (the evaluations use prompts 1-8)."""
import sys, json, torch
from pathlib import Path
from transformers import AutoModel
from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.commands.benchmark import Method, run_benchmark
from transformers_specblock.hub.shipped import resolve_drafter_path
torch.set_num_threads(1)
OFF = {"prompt_lookup_num_tokens": 0, "ngram_cache_num_tokens": 0, "suffix_cache_num_tokens": 0, "suffix_local_num_tokens": 0}
out = Path(sys.argv[1]); penalties = [float(x) for x in sys.argv[2].split(",")]; budgets = [int(x) for x in sys.argv[3].split(",")]
target, tok = load_packaged_model("smollm2-135m-instruct", dtype=torch.float32)
drafter = AutoModel.from_pretrained(resolve_drafter_path("specblock-smollm2-135m-instruct")).eval()
drafter.bind_target(target)
prompts = load_prompts("sharegpt", num_prompts=20, tokenizer=tok).select(range(8, 20))
methods = [Method(f"p{p}@{b}", {"assistant_model": drafter}, {"tree_budget": b, "off_chain_penalty": p, **OFF}) for b in budgets for p in penalties]
out.mkdir(parents=True, exist_ok=True)
res = run_benchmark(target, tok, prompts, methods, max_new_tokens=64, output_dir=out)
s = res.summary()
print(json.dumps({m.name: (round(s[m.name]["tau"], 3), s[m.name]["identical_to_reference"]) for m in methods}, indent=1))
