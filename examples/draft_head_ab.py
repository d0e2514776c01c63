"""Same-run A/B of the drafters' head when reading context: on every observed position (before) vs the last one
only (after, `logits_to_keep=1`), bfloat16 target, shipped drafters at budget 8, MT-Bench, interleaved per prompt.
Numbers in docs/benchmarks.md ("Drafting cost: the head only where it is used")."""
import time, torch, statistics
import transformers_specblock as t
from transformers import AutoModel
from transformers_specblock.hub import shipped_drafter_path
from transformers_specblock.generation.candidate_generators import specblock as sbgen, eagle3 as e3gen
torch.manual_seed(0); torch.set_num_threads(1)
target, tok = t.load_packaged_model("smollm2-135m-instruct", dtype=torch.bfloat16)
prompts = t.load_prompts("mt_bench", num_prompts=4, tokenizer=tok)
orig_sb, orig_e3 = sbgen.SpecBlockDraftModel.draft_blocks, e3gen.Eagle3DraftModel.draft_step
def all_sb(self, *a, logits_to_keep=0, **k): return orig_sb(self, *a, logits_to_keep=0, **k)
def all_e3(self, *a, logits_to_keep=0, **k): return orig_e3(self, *a, logits_to_keep=0, **k)
res = {}
for name in ("specblock", "eagle3"):
    drafter = AutoModel.from_pretrained(shipped_drafter_path(f"{name}-smollm2-135m-instruct"), dtype=torch.bfloat16).eval()
    cls = sbgen.SpecBlockDraftModel if name == "specblock" else e3gen.Eagle3DraftModel
    attr, patched = ("draft_blocks", all_sb) if name == "specblock" else ("draft_step", all_e3)
    for rep in range(2):
        for row in prompts:
            inputs = tok(row["text"], return_tensors="pt", add_special_tokens=False)
            for mode in ("before", "after"):
                setattr(cls, attr, patched if mode == "before" else (orig_sb if name == "specblock" else orig_e3))
                with drafter.tree_settings(tree_budget=8):
                    target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=48)
                s = drafter.last_stats
                if rep:
                    res.setdefault((name, mode), []).append((s.drafter_time_s / s.iterations, s.total_time_s / s.new_tokens, s.tau))
    setattr(cls, attr, orig_sb if name == "specblock" else orig_e3)
for (name, mode), rows in res.items():
    print(f"{name:9s} {mode:6s} drafting/iter {1000*statistics.mean(r[0] for r in rows):6.2f} ms  s/token {1000*statistics.mean(r[1] for r in rows):6.2f} ms  tau {statistics.mean(r[2] for r in rows):.2f}")
