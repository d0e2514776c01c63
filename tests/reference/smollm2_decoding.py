"""SpecBlock decoding on SmolLM2-135M-Instruct (float32, greedy): this package's `generate` against the SpecBlock
reference harness's greedy loop, with one drafter passed through both layouts.

No drafter for SmolLM2 exists in the reference's layout, and the package's cannot be exported as they are (their rank
head has biases and their top-1 rank feature is normalised over the whole draft vocabulary). `reference_compatible`
derives one from the weights of the shipped SpecBlock drafter (`specblock-smollm2-135m-instruct`, the package's own
copy: no second copy of its weights is kept for this comparison; the fixture records their sha256, and a test that
replays it asks for this script to be rerun when another drafter ships): the rank-head biases dropped, the top-1
feature over the top 20 logits, follow-up blocks at block 1's positions (every other weight as shipped). It is exported with
`save_pretrained(checkpoint_format="specblock_reference")`, loaded strictly by the reference's inference model for the
harness and by `SpecBlockDraftModel.from_pretrained(..., target=)` here. Both then decode the same prompts (MT-Bench
and HumanEval prompt sets shipped with the package, chat template applied): the harness at its defaults (two block
steps, 90 tree tokens, rank features over the top 10; `reference_decoding.harness_decode` lists the CPU stand-ins),
`generate` with `tree_budget=90`, `max_blocks=2`, `tree_construction="reference"`, `context_feeding="reference"` (the
harness's way of feeding the drafter its context) and rank features over the top 10.

    PYTHONPATH=src python tests/reference/smollm2_decoding.py /path/to/SpecBlock \
        --output docs/results/specblock-reference-smollm2/decoding.json \
        --fixture tests/reference/fixtures/smollm2_decoding.json

Both outputs are compared with the target's own greedy tokens, and step by step with each other (accepted counts).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from reference_code import load_harness_tree_module, load_reference  # noqa: E402
from reference_decoding import harness_decode  # noqa: E402

from transformers_specblock import SpecBlockDraftModel, load_prompts  # noqa: E402
from transformers_specblock.hub import shipped_drafter_path  # noqa: E402
from transformers_specblock.hub.loading import load_model  # noqa: E402

FROZEN_DRAFTER = shipped_drafter_path("specblock-smollm2-135m-instruct")  # the comparison's drafter


def drafter_sha256(folder: Path = FROZEN_DRAFTER) -> str:
    """The sha256 of the comparison drafter's weights (the fixture was made with these)."""
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def reference_compatible(drafter: SpecBlockDraftModel) -> SpecBlockDraftModel:
    """`drafter` without what the reference cannot represent: no rank-head biases, the top-1 rank feature within the
    top 20 logits, follow-up blocks at block 1's positions; every other weight unchanged."""
    config = copy.deepcopy(drafter.config)
    config.rank_head_bias, config.rank_top1_over_vocab, config.rank_feature_top_k = False, False, 20
    config.followup_positions = "block1"
    derived = SpecBlockDraftModel(config).to(drafter.dtype).eval()
    state = {k: v for k, v in drafter.state_dict().items() if not (k.startswith("rank_head.") and k.endswith(".bias"))}
    derived.load_state_dict(state, strict=True)
    return derived


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", help="a checkout of github.com/shiweijiezero/SpecBlock")
    parser.add_argument("--export_dir", default=None, help="where the reference-layout drafter is written (kept)")
    parser.add_argument("--output", required=True, help="JSON file of the per-step comparison")
    parser.add_argument("--fixture", default=None, help="also write the test fixture (tests/reference/fixtures/...)")
    parser.add_argument("--num_prompts", type=int, default=3, help="prompts per set (MT-Bench, HumanEval)")
    parser.add_argument("--max_new_tokens", type=int, default=48)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
    target.generation_config.eos_token_id = None  # the harness's tokenizer stand-in has no end of sequence either
    shipped = SpecBlockDraftModel.from_pretrained(FROZEN_DRAFTER, target=target, dtype=torch.float32).eval()
    folder = Path(args.export_dir or tempfile.mkdtemp())
    derived = reference_compatible(shipped)
    derived.bind_target(target)
    derived.save_pretrained(folder, checkpoint_format="specblock_reference")
    drafter = SpecBlockDraftModel.from_pretrained(folder, target=target).eval()
    drafter.config.rank_feature_top_k = 10  # as the harness computes rank features (RANK_TOPK 10)
    prompts = []
    for name in ("mt_bench", "humaneval"):
        for index, row in enumerate(load_prompts(name, num_prompts=args.num_prompts, tokenizer=tokenizer)):
            ids = tokenizer(row["text"], return_tensors="pt", add_special_tokens=False).input_ids[0]
            prompts.append((name, index, ids))
    load_reference(args.reference)
    harness = load_harness_tree_module(args.reference)
    steps = harness_decode(harness, folder, target, [ids for _, _, ids in prompts], drafter.config.target_layer_ids,
                           args.max_new_tokens)  # fmt: skip
    rows = []
    for (name, index, ids), theirs in zip(prompts, steps):
        with torch.no_grad():
            plain = target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), do_sample=False,
                                    max_new_tokens=args.max_new_tokens)[0, len(ids) :]  # fmt: skip
        with drafter.tree_settings(max_blocks=2):
            out = target.generate(ids[None], attention_mask=torch.ones_like(ids[None]), assistant_model=drafter,
                                  do_sample=False, tree_budget=90,
                                  max_new_tokens=args.max_new_tokens, tree_construction="reference",
                                  context_feeding="reference")  # fmt: skip
        ours = drafter.last_stats.accepted_per_iteration
        their_counts = [len(step) for step in theirs]  # tokens committed per step: the root and the accepted ones
        their_text = [t for step in theirs for t in step]  # each step's root is the previous step's bonus token
        leading = next((i for i, (a, b) in enumerate(zip(their_counts, ours)) if a != b), min(len(ours), len(theirs)))
        common = min(len(plain), len(their_text))
        rows.append({
            "prompt_set": name, "index": index, "prompt_tokens": len(ids),
            "ours_equals_greedy": bool(torch.equal(out[0, len(ids) :], plain)),
            "harness_equals_greedy_prefix": their_text[:common] == plain[:common].tolist(),
            "steps_ours": len(ours), "steps_harness": len(theirs), "identical_leading_steps": leading,
            "accepted_ours": ours, "accepted_harness": their_counts,
            "tau_ours": drafter.last_stats.tau, "tau_harness": sum(their_counts) / max(1, len(theirs)),
        })  # fmt: skip
        print(json.dumps({k: v for k, v in rows[-1].items() if not k.startswith("accepted")}), flush=True)
    result = {"target": "smollm2-135m-instruct", "dtype": "float32", "max_new_tokens": args.max_new_tokens,
              "reference_commit": "b7938c556e5dc42236362dcc4eb37a1edb562c70", "drafter_sha256": drafter_sha256(),
              "rows": rows}  # fmt: skip
    write_json(result, Path(args.output))
    if args.fixture:
        write_json(fixture_of(result), Path(args.fixture))
    return 0


REPLAYED = (("mt_bench", 0), ("humaneval", 0), ("humaneval", 2))  # each set's first prompt, and HumanEval's third
# (where, with the drafter shipped until 2026-12-04, feeding the drafter this package's way changed a step)


def fixture_of(result: dict) -> dict:
    """What `tests/test_specblock_reference.py` replays: the harness's accepted counts on the `REPLAYED` prompts."""
    keys = ("prompt_set", "index", "accepted_harness")
    rows = [{k: row[k] for k in keys} for row in result["rows"] if (row["prompt_set"], row["index"]) in REPLAYED]
    keep = ("target", "dtype", "max_new_tokens", "reference_commit", "drafter_sha256")
    return {k: result[k] for k in keep} | {"rows": rows}


def write_json(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=1))
    os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    raise SystemExit(main())
