"""Accept: the longest path of the tree the target agrees with (greedy), or lossless speculative sampling."""

from __future__ import annotations

import torch

from .tree import DraftTree


def greedy_accept(tree: DraftTree, processed: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Longest root path whose tokens equal the target's argmax; returns (accepted node ids, bonus token)."""
    choice = processed.argmax(-1).to(tree.tokens.device)  # [N+1] target's pick after each node
    matches = tree.tokens == choice[tree.parents.clamp(min=0)]
    matches[0] = True
    on_path = ~(tree.ancestor_matrix() & ~matches[None, :]).any(-1)  # every ancestor matched
    # siblings hold distinct tokens, so the matching nodes form one chain; order it by depth
    path = on_path.nonzero().squeeze(1)
    path = path[torch.argsort(tree.depths[path])][1:]
    last = path[-1] if path.numel() else torch.zeros((), dtype=torch.long, device=path.device)
    return path, choice[last].reshape(1)


def sample_accept(
    tree: DraftTree, processed: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Lossless multi-candidate speculative sampling over the tree.

    At each node the children are deterministic candidates (q = 1), tried best-first: accept x with probability
    p(x) under the current residual p; on rejection set p(x) = 0 and renormalise. When every child is rejected (or
    at a leaf), the bonus token is sampled from the residual. The result is distributed exactly as p.
    """
    probs = processed.softmax(-1)
    node, path = 0, []
    while True:
        residual = probs[node].clone()
        accepted = None
        for child in tree.children_of(node).tolist():
            token = tree.tokens[child]
            draw = torch.rand((), device=residual.device, generator=generator)
            if draw * residual.sum() < residual[token]:
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
            return torch.tensor(path, dtype=torch.long, device=tree.tokens.device), bonus
        path.append(accepted)
        node = accepted
