"""16-bit greedy exactness, measured: where an output leaves plain greedy, how close was the call in float32?

In bfloat16 / float16 a tree forward uses other matmul shapes than a one-token step, so where the target's two best
next tokens are nearly tied the 16-bit pick can flip (plain 16-bit greedy itself flips there when the prompt is
merely prefilled in two chunks). Such a flip is round-off, not a bug; a flip where the float32 logits are far apart
is a bug. `first_divergence` tells them apart: it finds the first position where a method's greedy tokens leave the
reference's and scores it with a float32 copy of the target (`float32_copy`):
``fp32_gap = |logit[reference token] - logit[method token]|`` of the float32 logits after the common prefix.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

__all__ = ["NEAR_TIE_GAP", "Divergence", "first_divergence", "first_divergence_in_batch", "float32_copy", "is_16bit"]

# Largest float32 logit gap a 16-bit flip may have and still count as a near-tie. A flip happens where the 16-bit gap
# between the two tokens is about zero, so its float32 gap is about the 16-bit round-off of that gap. Measured on
# SmolLM2-135M-Instruct in bfloat16 (7,988 MT-Bench prompt positions, the float32 top-2 tokens): round-off of the gap
# median 0.06, p99 0.33, p99.9 0.55, max 0.69 (top logits reach 49, where one bfloat16 step is 0.25); the flips of
# tree decoding and of a two-chunk prefill sat at 0.007-0.15 (docs/benchmarks.md). Not a proof against bugs: even the
# target's own runner-up is within 0.5 at 26% of those positions (median 1.15), so one bug-made divergence may pass
# while a bug that diverges on several prompts is caught.
NEAR_TIE_GAP = 0.75


@dataclass(frozen=True)
class Divergence:
    """The first position where a method's tokens leave the reference's.

    `position` counts new tokens (0 = the first generated token). `fp32_gap` is
    ``|logit[reference_token] - logit[method_token]|`` in float32 after ``prompt + reference[:position]``; it is
    ``inf`` where one output merely stops earlier (no competing token: not explained by a near-tie).
    """

    position: int
    reference_token: int | None
    method_token: int | None
    fp32_gap: float

    def is_near_tie(self, threshold: float = NEAR_TIE_GAP) -> bool:
        return self.fp32_gap <= threshold


def is_16bit(model: PreTrainedModel) -> bool:
    """Whether the model computes in bfloat16 or float16 (where greedy may flip at near-ties)."""
    return model.dtype in (torch.bfloat16, torch.float16)


def float32_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A float32 copy of `model` on the same device(s), in eval mode; `model` itself if it is float32 already.

    Costs one float32 set of weights (4 bytes per parameter) for as long as it is kept.
    """
    if model.dtype == torch.float32:
        return model
    return copy.deepcopy(model).float().eval()


@torch.no_grad()
def first_divergence(
    float32_target: PreTrainedModel,
    prompt_ids: torch.LongTensor | list[int],
    reference: list[int],
    tokens: list[int],
) -> Divergence | None:
    """Where `tokens` first leaves `reference` (both: new tokens only) and the float32 logit gap there.

    Args:
        float32_target: the target in float32 (`float32_copy`).
        prompt_ids: the prompt, ``(1, P)`` or ``(P,)`` or a list of P ids.
        reference: plain greedy's new tokens (R ids).
        tokens: the method's new tokens (T ids).

    Returns None when the two are identical; else the `Divergence` (one float32 forward over the
    ``P + position`` tokens before it, run only where there is a divergence).
    """
    position = next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), None)
    if position is None:
        if len(reference) == len(tokens):
            return None
        position = min(len(reference), len(tokens))  # one output stops earlier: no token pair to compare
        longer = reference if len(reference) > len(tokens) else tokens
        ref_tok = reference[position] if longer is reference else None
        return Divergence(position, ref_tok, None if longer is reference else tokens[position], math.inf)
    ref_tok, method_tok = reference[position], tokens[position]
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1).tolist()
    device = float32_target.get_input_embeddings().weight.device
    input_ids = torch.tensor([prompt + reference[:position]], device=device)  # (1, P + position)
    logits = float32_target(input_ids=input_ids, logits_to_keep=1).logits[0, -1].float()  # (V,)
    return Divergence(position, ref_tok, method_tok, abs(float(logits[ref_tok] - logits[method_tok])))


def first_divergence_in_batch(
    float32_target: PreTrainedModel,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None,
    reference_rows: list[list[int]],
    token_rows: list[list[int]],
) -> Divergence | None:
    """`first_divergence` for every row of a left-padded batch, each row scored alone on its own prompt (its padding
    dropped: the float32 question is whether the target itself could tell the two tokens apart there).

    Returns the divergence with the largest float32 gap (the row least explained by a near-tie), or None when every
    row equals its reference row.
    """
    worst = None
    for row, (reference, tokens) in enumerate(zip(reference_rows, token_rows)):
        prompt = input_ids[row] if attention_mask is None else input_ids[row][attention_mask[row].bool()]
        divergence = first_divergence(float32_target, prompt, reference, tokens)
        if divergence is not None and (worst is None or divergence.fp32_gap > worst.fp32_gap):
            worst = divergence
    return worst
