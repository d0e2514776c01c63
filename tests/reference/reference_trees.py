"""Tree fixtures: the SpecBlock reference harness's pruning, block-1 trees and a round of follow-up blocks drafted by
its own inference model (see `make_specblock_fixtures.py`)."""

from __future__ import annotations

import collections
import os
import types
from pathlib import Path

import numpy as np
import torch
from reference_code import (
    HEADS, HIDDEN, K, KV_HEADS, LAYERS, POSITIONS, TREE_HEAD_SCALES, VOCAB, _NoEvent, harness_module,
    harness_rank_logits,
)  # fmt: skip
from safetensors.torch import load_file


def pruning_cases(harness, generator, cases: int = 24) -> tuple[dict[str, torch.Tensor], dict]:
    """Random trees (node i's parent < i, -1 = the root; cumulative draft log-probs that fall along every path, as
    drafted trees' do) pruned by the harness's `_prune_tree_np` (`COVERAGE_PRUNE` off, its default) to a budget."""
    out, budgets = {}, []
    holder = types.SimpleNamespace(_coverage_prune=False)
    for case in range(cases):
        num = int(torch.randint(20, 80, (1,), generator=generator))
        budget = int(torch.randint(5, num, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(1, num)]
        step = torch.rand(num, generator=generator, dtype=torch.float64) * 3.0 + 1e-3
        lps = []
        for i, parent in enumerate(parents):
            lps.append((lps[parent] if parent >= 0 else 0.0) - float(step[i]))
        buffers = [np.arange(num, dtype=np.int64) + 1000, np.array(parents, dtype=np.int64),
                   np.array(lps, dtype=np.float64)] + [np.zeros(num, dtype=np.int64) for _ in range(3)]  # fmt: skip
        kept = harness._SpecBlockAlgorithmBase._prune_tree_np(holder, num, *buffers, budget)
        out[f"prune{case}.parents"] = torch.tensor(parents)
        out[f"prune{case}.lps"] = torch.tensor(lps, dtype=torch.float64)
        out[f"prune{case}.kept"] = torch.tensor(sorted(int(t) - 1000 for t in buffers[0][:kept]))
        budgets.append(budget)
    return out, {"pruning_budgets": budgets}


def block1_trees(modules, harness, model, folder: Path, generator) -> tuple[dict, dict]:
    """Block-1 trees the harness builds (`_build_tree_from_block1`, one block step so no follow-up forward) at
    `SpecBlockAlgorithm._PARETO_DEFAULTS` (slot widths "slim_r2" [2, 4, 6, 4], `ADAPTIVE_SLOT0` and `ADAPTIVE_ALL` 1,
    beam width 10, 90 tree tokens) for the reference drafter's block 1 at the last of 6 random positions, rank logits
    as the harness computes them (`RANK_TOPK` 10), with `lm_head` scaled by TREE_HEAD_SCALES (confident slots).
    `torch.cuda.synchronize` is a no-op here (the CPU has nothing to wait for) and the final
    `build_tree_buffers_triton` (Triton kernels turning nodes into masks) is replaced by a recorder of the nodes it
    receives: tokens (target ids) and parents (-1 = the root)."""
    settings = {**harness_module(harness, "specblock").SpecBlockAlgorithm._PARETO_DEFAULTS}
    for key, value in settings.items():
        os.environ.setdefault(key, value)
    algorithm = harness_module(harness, "specblock").SpecBlockAlgorithm(
        model_path="target", draft_model_path=str(folder), device="cpu", total_tokens=90, max_blocks=1, beam_width=10
    )
    algorithm.draft_model = model
    algorithm._block_forward_events = {}
    recorded = []

    def record(n_nodes, tokens, parents, sample_token, device, k_slots, max_blocks):
        recorded.append((tokens[:n_nodes].copy(), parents[:n_nodes].copy()))
        return None, None, None, None

    torch.cuda.synchronize = lambda *args, **kwargs: None
    harness.build_tree_buffers_triton = record
    out, head = {}, model.lm_head.weight.detach().clone()
    for case, scale in enumerate(TREE_HEAD_SCALES):  # sharper heads: confident slots, where the harness narrows
        features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
        with torch.no_grad():
            model.lm_head.weight.copy_(head * scale)
            logits, _, hidden, _, _ = model.forward_parallel(features, ids, torch.ones_like(ids))
            rank_logits = harness_rank_logits(modules, model, hidden[:, -1], 10)
            model.lm_head.weight.copy_(head)
        ttt = [(torch.zeros(1, KV_HEADS, K, HIDDEN // HEADS),) * 2 for _ in range(LAYERS)]
        cache = [[torch.zeros(1, KV_HEADS, 64, HIDDEN // HEADS), torch.zeros(1, KV_HEADS, 64, HIDDEN // HEADS),
                  POSITIONS * K, 64] for _ in range(LAYERS)]  # fmt: skip
        algorithm._build_tree_from_block1(logits[:, -1], rank_logits, hidden[:, -1], ttt, ids[:, -1:], cache,
                                          POSITIONS - 1)  # fmt: skip
        tokens, parents = recorded.pop()
        parts = {"features": features, "input_ids": ids, "tokens": torch.from_numpy(tokens),
                 "parents": torch.from_numpy(parents)}  # fmt: skip
        out.update({f"tree{case}.{name}": value for name, value in parts.items()})
    info = {"lm_head_scales": list(TREE_HEAD_SCALES), "settings": settings, "beam_width": 10, "total_tokens": 90,
            "rank_topk": 10}  # fmt: skip
    return out, {"block1_trees": info}


def followup_round(harness, folder: Path, generator, scales=(1.0, 6.0)) -> tuple[dict, dict]:
    """Two-block trees drafted by the harness's own inference model (`SpecBlockInferenceModel`, float32 here, the
    harness runs bfloat16): `prefill_and_draft` on 5 random context positions and the first drafted position, then
    `_build_tree_from_block1` at the harness's defaults with two block steps. Recorded: the context, block 1, every
    follow-up block of the round (`forward_with_cache`: start slot states, tokens, which of block 1's slots each
    sees, its logits / rank logits / slot states) and the final tree (nodes, parents) after pruning to 90."""
    from transformers import LlamaConfig

    torch.cuda.Event = _NoEvent
    torch.cuda.synchronize = lambda *args, **kwargs: None
    config = LlamaConfig.from_pretrained(folder)
    model = harness_module(harness, "specblock_inference_model").SpecBlockInferenceModel(config).float().eval()
    result = model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
    assert result.missing_keys == ["input_layer.embed_tokens.weight"] and not result.unexpected_keys, result
    model.load_vocab_mapping(str(folder / "vocab_mapping.pt"))
    embedding = load_file(folder.parent / "target_embedding.safetensors")["weight"]
    model.input_layer.embed_tokens.weight.data.copy_(embedding)
    model.prepare_for_inference()
    head = model.lm_head.weight.detach().clone()
    algorithm = harness_module(harness, "specblock").SpecBlockAlgorithm(
        model_path="target", draft_model_path=str(folder), device="cpu", total_tokens=90, max_blocks=2, beam_width=10
    )
    algorithm.draft_model = model
    algorithm._block_forward_events = collections.defaultdict(list)
    calls, trees = [], []
    forward = model.forward_with_cache

    def record_forward(**kwargs):
        out = forward(**kwargs)
        calls.append((kwargs["hidden"], kwargs["input_ids"], kwargs["ttt_mask"], kwargs["position_id"], *out[:3]))
        return out

    model.forward_with_cache = record_forward
    harness.build_tree_buffers_triton = lambda n, tokens, parents, *rest: trees.append(
        (tokens[:n].copy(), parents[:n].copy())
    ) or (None, None, None, None)
    out = {}
    for case, scale in enumerate(scales):
        features = torch.randn(1, POSITIONS, 3 * HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (1, POSITIONS), generator=generator)
        with torch.no_grad():
            model.lm_head.weight.copy_(head * scale)
            cache, position, logits, rank, hidden, ttt = model.prefill_and_draft(
                features[:, :-1], ids[:, :-1], features[:, -1:], ids[:, -1:]
            )
            algorithm._build_tree_from_block1(logits, rank, hidden, ttt, ids[:, -1:], cache, position - 1)
            model.lm_head.weight.copy_(head)
        (start, tokens, seen, position_id, f_logits, f_rank, f_hidden), (nodes, parents) = calls.pop(), trees.pop()
        assert not calls and position_id == position - 1
        out.update({f"round{case}.{name}": t for name, t in (
            ("features", features), ("input_ids", ids), ("block1.logits", logits), ("block1.rank_logits", rank),
            ("block1.hidden", hidden), ("start_states", start[:, 0]), ("start_tokens", tokens[:, 0]),
            ("seen_block1_slots", seen.sum(-1)), ("logits", f_logits), ("rank_logits", f_rank),
            ("hidden", f_hidden), ("tree.tokens", torch.from_numpy(nodes)),
            ("tree.parents", torch.from_numpy(parents)))})  # fmt: skip
    return out, {"followup_rounds": {"lm_head_scales": list(scales), "context_positions": POSITIONS - 1,
                                     "max_blocks": 2, "total_tokens": 90, "beam_width": 10}}  # fmt: skip
