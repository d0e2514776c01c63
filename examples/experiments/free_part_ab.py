"""A/B in one process: `tree_budget="auto"` with and without the free-part estimate (drafted trees also measuring
what their free candidates alone would have committed, `AutoBudget.observe_free_part`), for the shipped drafters
as shipped (auto + prompt lookup, n-gram cache, suffix cache), against plain `generate`, interleaved per batch in a
rotating order, on the packaged SmolLM2-135M-Instruct.

    python examples/experiments/free_part_ab.py --dataset mt_bench --num_prompts 16 --batch_size 1 --output out/free-part-ab/mt_bench-b1.json

"without" is the same drafter class and weights in a second object whose chooser skips the free-part samples (the
code before the change); each object keeps its own chooser across the batches, as a served drafter does, and
forgets the text it served after every call (as the benchmark does), so no arm copies an answer it saw. Reports per
arm the total-token speed-up over plain and the median of per-batch ratios; outputs are checked against plain.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel

from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.generation.budget import AutoBudget
from transformers_specblock.hub.provenance import describe_device
from transformers_specblock.hub.shipped import resolve_drafter_path


class WithoutFreePart(AutoBudget):
    """The chooser before the change: drafted trees tell nothing about budget 0."""

    def observe_free_part(self, tree, path) -> None:
        pass


def forget(drafter) -> None:
    """Drop the text the drafter served (its suffix store), keeping what its chooser learnt."""
    store = drafter.__dict__.get("_suffix_store")
    if store is not None:
        store.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="mt_bench")
    parser.add_argument("--num_prompts", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--drafters", default="eagle3,specblock,dflash")
    parser.add_argument("--output", required=True)
    args = parser.parse_args()

    torch.set_num_threads(1)
    target, tok = load_packaged_model("smollm2-135m-instruct", dtype=getattr(torch, args.dtype))
    tok.padding_side = "left"
    arms: dict[str, object] = {"plain": None}
    for kind in args.drafters.split(","):
        for arm in ("with", "without"):
            drafter = AutoModel.from_pretrained(resolve_drafter_path(f"{kind}-smollm2-135m-instruct")).eval()
            drafter.to(target.dtype)
            arms[f"{kind}/{arm}"] = drafter
    prompts = load_prompts(args.dataset, num_prompts=args.num_prompts, tokenizer=tok)["text"]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    settings = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)

    def call(name: str, inputs) -> tuple[torch.Tensor, float]:
        drafter = arms[name]
        start = time.perf_counter()
        out = target.generate(**inputs, **settings, **({"assistant_model": drafter} if drafter is not None else {}))
        seconds = time.perf_counter() - start
        if drafter is not None:
            forget(drafter)
        return out, seconds

    warm = tok(batches[0], return_tensors="pt", padding=True, add_special_tokens=False)
    for name, drafter in arms.items():  # warm-up: kernels, and each chooser's cost curve and first trees
        call(name, warm)
        if name.endswith("/without"):
            chooser = drafter.serving_state().auto_budget
            chooser.__class__ = WithoutFreePart
            chooser.free_part_tau.samples.clear(), chooser.free_part_size.samples.clear()
            chooser.free_part_tau.count = 0
    seconds = {name: [] for name in arms}
    exact = {name: True for name in arms}
    names = list(arms)
    for b, batch in enumerate(tqdm(batches, desc="batches")):
        inputs = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        outputs = {}
        for name in names[b % len(names) :] + names[: b % len(names)]:  # rotating order
            outputs[name], s = call(name, inputs)
            seconds[name].append(s)
        for name in names:
            exact[name] &= outputs[name].tolist() == outputs["plain"].tolist()
    plain = seconds["plain"]
    summary = {
        name: {
            "speedup": sum(plain) / sum(secs),
            "median_batch_ratio": statistics.median(p / s for p, s in zip(plain, secs)),
            "identical_to_plain": exact[name],
        }
        for name, secs in seconds.items()
    }
    for name, row in summary.items():
        print(f"{name:20s} {row['speedup']:.3f}x (median per batch {row['median_batch_ratio']:.3f}x) "
              f"identical={row['identical_to_plain']}")  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    settings_out = vars(args) | {"hardware": describe_device(target.device)}
    Path(args.output).write_text(json.dumps({"settings": settings_out, "summary": summary, "seconds": seconds}, indent=2))


if __name__ == "__main__":
    main()
