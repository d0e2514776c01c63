"""Freeze what the SpecBlock reference code computes into small fixtures (tests/reference/fixtures/).

    PYTHONPATH=src python tests/reference/make_specblock_fixtures.py /path/to/SpecBlock [--check_flex]

The reference (github shiweijiezero/SpecBlock, Apache-2.0) is not a registry package: `reference_code.py` imports
its pure-PyTorch modules from a checkout without running the package `__init__` files (they import SGLang), with
TorchDynamo disabled (its `torch.compile` decorators run eagerly), and says what stands in for its GPU-only parts.
Nothing of the reference is copied into this package; `tests/test_specblock_reference.py` compares against the
fixtures without it.

Outputs, float32 on tiny random weights (hidden 64, 2 layers, 4 heads / 2 KV heads, K 4, vocabulary 256, draft
vocabulary 128, 4 rank classes):
* `reference_drafter/`: the drafter as the reference's `save_pretrained` writes it, plus `vocab_mapping.pt`.
* `target_embedding.safetensors`: the token embedding the drafter reads (the target's).
* `modeling.safetensors`: block 1 and two training-time follow-up blocks (`forward_parallel` with its caches and
  masks), the masks, the harness's rank logits (`RANK_TOPK` 10 and 20), and the reference class's weights and outputs
  after loading this package's `specblock_reference` export.
* `training.safetensors`: one batch, the reference's per-block loss terms and rank labels, and one training step
  (`reference_training.py`).
* `trees.safetensors`: pruning, block-1 trees and a round of follow-up blocks of the inference harness
  (`reference_trees.py`).
* `decoding_drafter/`, `decoding.safetensors`: a drafter trained by the reference's training code on a tiny target
  and what the harness's greedy loop commits with it, iteration by iteration, and what it feeds its drafter at each
  iteration: the tokens, the rotary position of the first, the cache entries attended besides them, the block-1
  logits (`reference_decoding.py`).
* `manifest.json`: the reference commit, the settings, the scalar results.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from reference_code import (
    DRAFT_VOCAB, FOLLOWUP_M, HEADS, HIDDEN, INTERMEDIATE, K, KV_HEADS, LAYERS, POSITIONS, RANK_CLASSES, VOCAB,
    check_flex, dense_mask,
    harness_rank_logits, load_harness_tree_module, load_reference, random_reference_drafter,
)  # fmt: skip
from reference_decoding import PROMPT_LENGTH, PROMPTS, harness_decode, tiny_target, train_reference_drafter
from reference_training import one_step, run_training, training_batch
from reference_trees import block1_trees, followup_round, pruning_cases
from safetensors.torch import load_file, save_file
def followup_inputs(draft_hidden, input_ids, m: int, offset: int):
    """What `OnlineSpecBlockModel.forward` feeds the next block: slot M-1's state and the token `offset` further."""
    length = input_ids.shape[1]
    shifted = (torch.arange(length) + offset).clamp(max=length - 1)
    return draft_hidden[:, :, m - 1, :], input_ids[:, shifted]


def run_blocks(modules, model, features, input_ids, ms=FOLLOWUP_M) -> tuple[dict[str, torch.Tensor], list]:
    """Block 1 and the training-time follow-up blocks, chained as `OnlineSpecBlockModel.forward` chains them."""
    out: dict[str, torch.Tensor] = {}
    mask_calls = []
    module = modules["blocks"]  # forward_parallel imports its mask builders from here at each call
    originals = {n: getattr(module, n) for n in ("build_block2plus_mask",)}

    def record(*args, **kwargs):
        mask = originals["build_block2plus_mask"](*args, **kwargs)
        mask_calls.append(dense_mask(mask))
        return mask

    length = input_ids.shape[1]
    condition, ids, draft_condition = features, input_ids, False
    cache, cross, counts, offset = None, None, [], 0
    try:
        module.build_block2plus_mask = record
        for b in range(1 + len(ms)):
            logits, rank, hidden, new_kv, _ = model.forward_parallel(
                condition, ids, torch.ones_like(ids), use_draft_condition=draft_condition, prev_kv_cache=cache,
                ttt_valid_counts=torch.stack(counts) if counts else None, cross_kv_cache=cross,
            )  # fmt: skip
            out.update({f"block{b + 1}.{n}": t for n, t in (("logits", logits), ("rank_logits", rank),
                                                              ("hidden", hidden), ("input_ids", ids))})  # fmt: skip
            out[f"block{b + 1}.condition"] = condition
            if b == len(ms):
                break
            m = ms[b]
            cross = cross if cross is not None else new_kv
            counts.append(torch.full((length,), m, dtype=torch.long))
            offset += m
            cache = new_kv if cache is None else [(torch.cat([a, c], 2), torch.cat([v, w], 2))
                                                  for (a, v), (c, w) in zip(cache, new_kv)]  # fmt: skip
            condition, ids = followup_inputs(hidden, input_ids, m, offset)
            draft_condition = True
    finally:
        module.build_block2plus_mask = originals["build_block2plus_mask"]
    for b, mask in enumerate(mask_calls, start=2):
        out[f"block{b}.mask"] = mask
    return out, mask_calls


def block1_mask(modules, length: int) -> torch.Tensor:
    return dense_mask(modules["blocks"].get_cached_cross_position_causal_mask(length, K, 1, "cpu"))


def check_our_export(modules, folder: Path, features, input_ids, expected: dict) -> dict[str, torch.Tensor]:
    """Load the reference checkpoint with this package, export it with `checkpoint_format="specblock_reference"`,
    load the export in the reference class (config through `LlamaConfig`, weights through `load_state_dict`,
    `vocab_mapping.pt` through its `load_vocab_mapping`) and run block 1 there."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from transformers_specblock import SpecBlockDraftModel

    embedding = load_file(folder.parent / "target_embedding.safetensors")["weight"]
    sizes = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, vocab_size=VOCAB)  # fmt: skip
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **sizes))
    target.get_input_embeddings().weight.data.copy_(embedding)
    ours = SpecBlockDraftModel.from_pretrained(folder, target=target)
    export = folder.parent / "_export"
    ours.save_pretrained(export, checkpoint_format="specblock_reference")
    config = LlamaConfig.from_pretrained(export)
    theirs = modules["draft"].LlamaForCausalLMSpecBlock(config).float()
    result = theirs.load_state_dict(load_file(export / "model.safetensors"), strict=False)
    if result.unexpected_keys or result.missing_keys != ["input_layer.embed_tokens.weight"]:
        raise RuntimeError(f"The export does not load strictly in the reference class: {result}")
    theirs.load_vocab_mapping(str(export / "vocab_mapping.pt"))
    theirs.input_layer.embed_tokens.weight.data.copy_(embedding)
    with torch.no_grad():
        logits, rank, hidden, _, _ = theirs.eval().forward_parallel(features, input_ids, torch.ones_like(input_ids))
    outputs = {"logits": logits, "rank_logits": rank, "hidden": hidden}
    diffs = {n: (a - expected[f"block1.{n}"]).abs().max().item() for n, a in outputs.items()}
    out = {f"export.{k}": v.detach().clone() for k, v in theirs.state_dict().items() if "embed" not in k}
    out.update({"export.block1.logits": logits, "export.block1.rank_logits": rank, "export.block1.hidden": hidden})
    for path in sorted(export.iterdir()):
        path.unlink()
    export.rmdir()
    return out, {"export_vs_reference_max_abs_diff": diffs, "export_missing_keys": result.missing_keys}


def decode(modules, harness, embedding: torch.Tensor, out: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Train a drafter with the reference's training code on the tiny target (`reference_decoding.py`), save it as
    the reference saves it (`decoding_drafter/`), and run the harness's greedy loop with it on PROMPTS prompts:
    `decoding.safetensors` holds the prompts, the tokens each iteration committed and their counts."""
    target = tiny_target(embedding)
    model = random_reference_drafter(modules, embedding)
    model.freeze_embedding()
    losses = train_reference_drafter(modules, model.train(), target, torch.Generator().manual_seed(7))
    folder = out / "decoding_drafter"
    folder.mkdir(exist_ok=True)
    model.eval().save_pretrained(str(folder))
    torch.save({"d2t": model.d2t.clone(), "t2d": model.t2d.clone()}, folder / "vocab_mapping.pt")
    prompts = torch.randint(0, VOCAB, (PROMPTS, PROMPT_LENGTH), generator=torch.Generator().manual_seed(8))
    feeds = []
    steps = harness_decode(harness, folder, target, prompts, feeds=feeds)
    tensors = {"prompts": prompts}
    for row, (iterations, fed) in enumerate(zip(steps, feeds)):
        tensors[f"prompt{row}.tokens"] = torch.tensor([t for it in iterations for t in it])
        tensors[f"prompt{row}.per_iteration"] = torch.tensor([len(it) for it in iterations])
        tensors[f"prompt{row}.fed_tokens"] = torch.tensor([t for feed in fed for t in feed["tokens"]])
        for key in ("position", "cached"):
            tensors[f"prompt{row}.fed_{key}"] = torch.tensor([feed[key] for feed in fed])
        tensors[f"prompt{row}.fed_count"] = torch.tensor([len(feed["tokens"]) for feed in fed])
        tensors[f"prompt{row}.block1_logits"] = torch.stack([feed["logits"] for feed in fed])
    atomic_save(tensors, out / "decoding.safetensors")
    taus = [sum(len(it) for it in its) / len(its) for its in steps]
    info = {"training_steps": len(losses), "first_loss": losses[0], "last_loss": losses[-1],
            "harness_tau": sum(taus) / len(taus), "max_blocks": 2, "total_tokens": 90}  # fmt: skip
    return tensors, {"decoding": info}


def commit_of(root: str) -> str:
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown (not a git checkout: pass --commit)"


def atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="A checkout of github.com/shiweijiezero/SpecBlock.")
    parser.add_argument("--output", default=str(Path(__file__).parent / "fixtures"))
    parser.add_argument("--commit", default=None, help="The reference commit (default: git rev-parse HEAD).")
    parser.add_argument("--check_flex", action="store_true", help="Also measure the dense attention substitution.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    modules = load_reference(args.reference)
    out = Path(args.output)
    (out / "reference_drafter").mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    embedding = torch.randn(VOCAB, HIDDEN) * 0.5
    atomic_save({"weight": embedding}, out / "target_embedding.safetensors")
    model = random_reference_drafter(modules, embedding)
    model.save_pretrained(str(out / "reference_drafter"))  # its own writer: config.json + model.safetensors
    torch.save({"d2t": model.d2t.clone(), "t2d": model.t2d.clone()}, out / "reference_drafter" / "vocab_mapping.pt")

    generator = torch.Generator().manual_seed(2)
    features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
    input_ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
    with torch.no_grad():
        modeling, _ = run_blocks(modules, model, features, input_ids)
        modeling["block1.mask"] = block1_mask(modules, POSITIONS)
        for top_k in (10, 20):
            rank_logits = harness_rank_logits(modules, model, modeling["block1.hidden"], top_k)
            modeling[f"harness.rank_logits_top{top_k}"] = rank_logits
    modeling.update({"inputs.features": features, "inputs.input_ids": input_ids})
    export, export_info = check_our_export(modules, out / "reference_drafter", features, input_ids, modeling)
    modeling.update(export)
    atomic_save(modeling, out / "modeling.safetensors")

    batch = training_batch(model, torch.Generator().manual_seed(3))
    model.freeze_embedding()
    training, training_info = run_training(modules, model, batch)
    training.update({f"batch.{k}": v for k, v in batch.items()})
    step, step_info = one_step(modules, random_reference_drafter(modules, embedding), batch)
    training.update(step)
    training_info.update(step_info)
    harness = load_harness_tree_module(args.reference)
    trees, trees_info = pruning_cases(harness, torch.Generator().manual_seed(4))
    folder = out / "reference_drafter"
    block1, block1_info = block1_trees(modules, harness, model, folder, torch.Generator().manual_seed(5))
    trees.update(block1)
    trees_info.update(block1_info)
    rounds, rounds_info = followup_round(harness, folder, torch.Generator().manual_seed(6))
    trees.update(rounds)
    trees_info.update(rounds_info)
    decoding, decoding_info = decode(modules, harness, embedding, out)
    atomic_save(trees, out / "trees.safetensors")
    atomic_save(training, out / "training.safetensors")

    manifest = {
        "reference": "github.com/shiweijiezero/SpecBlock",
        "commit": args.commit or commit_of(args.reference),
        "torch": torch.__version__,
        "sizes": dict(hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, intermediate=INTERMEDIATE,
                      vocab=VOCAB, draft_vocab=DRAFT_VOCAB, block_size=K, rank_classes=RANK_CLASSES,
                      positions=POSITIONS),  # fmt: skip
        "followup_m": list(FOLLOWUP_M),
        "attention": "flex_attention answered by dense softmax attention over the reference mask_mod",
        **export_info,
        **training_info,
        **trees_info,
        **decoding_info,
        "loss": {k: v.tolist() for k, v in training.items() if k.startswith("loss.")},
    }
    if args.check_flex:
        manifest["dense_vs_flex_attention_max_abs_diff"] = check_flex(modules, model, features, input_ids)
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, out / "manifest.json")
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
