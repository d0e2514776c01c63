"""The draft vocabulary (``d2t`` / ``t2d``: the most frequent assistant tokens of the training data) and a new
drafter's head (and, on request, its decoder layers) initialised from the target's."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from ..models.specblock.modeling_specblock import SpecBlockDraftModel
from .features import _target_head

logger = logging.get_logger(__name__)


def default_draft_vocab_size(vocab_size: int) -> int:
    """The full vocabulary up to 16384 tokens; 16384 up to 65536 (SmolLM2: 49152 -> 16384); 32000 above
    (Llama 3 / Qwen2.5: the reference EAGLE-3 size)."""
    if vocab_size <= 16384:
        return vocab_size
    return 16384 if vocab_size <= 65536 else 32000


def build_draft_vocab(
    token_lists: Iterable[Sequence[int]], mask_lists: Iterable[Sequence[int]], vocab_size: int, draft_vocab_size: int
) -> tuple[torch.LongTensor, float]:
    """``d2t``: the ``draft_vocab_size`` most frequent assistant tokens (ties: lower id first; ids never seen fill
    up from the lowest id), sorted by target id; and the fraction of assistant tokens it covers."""
    # one bincount over every assistant token (numpy per row: thousands of tiny torch ops crawl when several
    # processes share the CPU cores, each with its own thread pool)
    parts = [np.asarray(ids, dtype=np.int64)[np.asarray(mask, dtype=bool)] for ids, mask in zip(token_lists, mask_lists)]
    tokens = torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)
    counts = torch.bincount(tokens, minlength=vocab_size)[:vocab_size]
    order = torch.sort(-counts, stable=True).indices  # most frequent first, ties by id
    d2t = torch.sort(order[:draft_vocab_size]).values
    coverage = float(counts[d2t].sum()) / max(1, int(counts.sum()))
    return d2t, coverage


def set_draft_vocab(drafter: SpecBlockDraftModel, d2t: torch.LongTensor) -> None:
    """Store a sorted draft->target id map into the drafter's ``d2t`` / ``t2d`` buffers."""
    if d2t.numel() != drafter.config.draft_vocab_size:
        raise ValueError(
            f"d2t has {d2t.numel()} ids, the drafter's draft_vocab_size is {drafter.config.draft_vocab_size}."
        )
    with torch.no_grad():
        drafter.d2t.copy_(d2t.to(drafter.d2t.device))
        drafter.t2d.zero_()
        drafter.t2d[drafter.d2t] = True


def init_head_from_target(drafter: SpecBlockDraftModel, target: PreTrainedModel) -> None:
    """Copy the target's final norm and its output-embedding rows `d2t` into the drafter's `norm` / `lm_head`."""
    weight, _ = _target_head(target)
    if weight.shape[1] != drafter.config.hidden_size:
        raise ValueError(
            f"--init_head_from_target needs the drafter hidden size ({drafter.config.hidden_size}) to equal the "
            f"target's ({weight.shape[1]}); pass --no_init_head_from_target."
        )
    final_norm = target.get_decoder().norm
    with torch.no_grad():
        drafter.lm_head.weight.copy_(weight[drafter.d2t.to(weight.device)].to(drafter.lm_head.weight))
        drafter.norm.weight.copy_(final_norm.weight.to(drafter.norm.weight))


def init_decoder_from_target(drafter: PreTrainedModel, target: PreTrainedModel) -> list[str]:
    """Copy the target's top decoder layers into the drafter's: drafter layer i of N starts as target layer L-N+i.
    Every weight whose name and shape match is copied; returns the names of those that did not (EAGLE-3's attention
    reads 2H-wide inputs, so its q/k/v projections stay random). Raises when nothing fits."""
    ours = list(drafter.layers) if hasattr(drafter, "layers") else [drafter.layer]
    theirs = list(target.get_decoder().layers)[-len(ours):]
    copied, skipped = 0, []
    with torch.no_grad():
        for index, (layer, source) in enumerate(zip(ours, theirs)):
            source_weights = source.state_dict()
            for name, weight in layer.state_dict().items():
                if name in source_weights and source_weights[name].shape == weight.shape:
                    weight.copy_(source_weights[name].to(weight))
                    copied += 1
                else:
                    skipped.append(f"layers.{index}.{name}")
    if not copied:
        raise ValueError(
            "--init_decoder_from_target: no decoder weight of the target fits the drafter's (hidden or "
            "intermediate sizes differ); drop the option."
        )
    if skipped:
        logger.warning(f"--init_decoder_from_target: kept random (no matching target weight): {', '.join(skipped)}.")
    return skipped
