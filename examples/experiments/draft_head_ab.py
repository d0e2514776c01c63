"""Same-run A/B of the drafters' head when reading context: on every observed position (before) vs the last one
only (after, `logits_to_keep=1`), bfloat16 target, shipped drafters at budget 8, MT-Bench, interleaved per prompt.
Numbers in docs/benchmarks.md ("Drafting cost: the head only where it is used")."""

from __future__ import annotations

import statistics

import torch
from transformers import AutoModel

import transformers_specblock as t
from transformers_specblock.hub import shipped_drafter_path
from transformers_specblock.models import Eagle3DraftModel, SpecBlockDraftModel

HEADS = {"specblock": (SpecBlockDraftModel, "draft_blocks"), "eagle3": (Eagle3DraftModel, "draft_step")}


def full_head(method):
    """The drafter forward with the head on every position, whatever the caller keeps (the code before)."""

    def forward(self, *args, logits_to_keep: int = 0, **kwargs):
        return method(self, *args, logits_to_keep=0, **kwargs)

    return forward


def main(num_prompts: int = 4, max_new_tokens: int = 48) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    target, tokenizer = t.load_packaged_model("smollm2-135m-instruct", dtype=torch.bfloat16)
    prompts = t.load_prompts("mt_bench", num_prompts=num_prompts, tokenizer=tokenizer)
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for name, (cls, attr) in HEADS.items():
        path = shipped_drafter_path(f"{name}-smollm2-135m-instruct")
        drafter = AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval()
        method = getattr(cls, attr)
        for round_ in ("warm-up", "measured"):
            for row in prompts:
                inputs = tokenizer(row["text"], return_tensors="pt", add_special_tokens=False)
                for mode in ("before", "after"):
                    setattr(cls, attr, full_head(method) if mode == "before" else method)
                    with drafter.tree_settings(tree_budget=8):
                        target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=max_new_tokens)
                    stats = drafter.last_stats
                    if round_ == "measured":
                        results.setdefault((name, mode), []).append(
                            (stats.drafter_time_s / stats.iterations, stats.total_time_s / stats.new_tokens, stats.tau)
                        )
        setattr(cls, attr, method)
    for (name, mode), rows in results.items():
        draft, per_token, tau = (statistics.mean(r[i] for r in rows) for i in range(3))
        print(f"{name:9s} {mode:6s} drafting/iter {1000 * draft:6.2f} ms  s/token {1000 * per_token:6.2f} ms  tau {tau:.2f}")


if __name__ == "__main__":
    main()
