"""Accept: per row, the longest path of its tree the target agrees with (greedy, all rows at once), or lossless
speculative sampling (one row at a time); then the kept nodes' scores."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..utils import to_device
from .tree import DraftTree
from .tree_batch import TreeBatch


def greedy_accept_rows(
    trees: TreeBatch, processed: torch.Tensor
) -> tuple[list[list[int]], torch.LongTensor, list[int] | None]:
    """Every row's longest root path whose tokens equal the target's argmax: the picks of the whole batch are read
    back once, then each row's path is walked down its tree's host copy (siblings hold distinct tokens, so a pick
    names at most one child).

    processed: [B, N+1, V]. Returns each row's kept nodes (root first, then the accepted nodes by depth) and the
    bonus tokens [B] (the target's pick after each row's last kept node), on the device and, where they were read
    back, on the host (None for a batch of roots alone, which reads nothing).
    """
    # [B, N+1] the target's pick after each node: `max` returns the first maximal index as argmax does, at half the
    # time of argmax on a CPU (and on bfloat16 rows as fast as on float32 ones)
    choice = processed.max(-1).indices.to(trees.tokens.device)
    if trees.size == 1:  # roots alone: nothing to accept, the pick is the bonus (no read)
        return [[0]] * trees.tokens.shape[0], choice[:, 0], None
    picks = choice.tolist()  # the one host read
    kept, bonus = [], []
    for row, tree in enumerate(trees.trees):
        path = [0]
        if len(tree) > 1:
            host = tree.host()
            children = {(parent, token): node for node, (parent, token) in enumerate(zip(host.parents, host.tokens))}
            while (child := children.get((path[-1], picks[row][path[-1]]))) is not None:
                path.append(child)
        kept.append(path)
        bonus.append(picks[row][path[-1]])
    return kept, to_device(bonus, trees.tokens.device), bonus


def greedy_accept(tree: DraftTree, processed: torch.Tensor) -> tuple[torch.LongTensor, torch.LongTensor]:
    """One tree (processed [N+1, V]): the accepted node ids (root excluded) and the bonus token [1]."""
    kept, bonus, _ = greedy_accept_rows(TreeBatch.pad([tree]), processed[None])
    return torch.tensor(kept[0][1:], dtype=torch.long, device=tree.tokens.device), bonus


def sample_accept(
    tree: DraftTree, processed: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Lossless multi-candidate speculative sampling over the tree (processed [N+1, V]).

    At each node the children are deterministic candidates (q = 1), tried best-first: accept x with probability
    p(x) under the current residual p; on rejection set p(x) = 0 and renormalise. When every child is rejected (or
    at a leaf), the bonus token is sampled from the residual. The result is distributed exactly as p.
    """
    return walk_accept(tree, lambda node, path: processed[node], True, generator)


def walk_accept(
    tree: DraftTree,
    node_scores: Callable[[int, list[int]], torch.Tensor],
    do_sample: bool,
    generator: torch.Generator | None = None,
    stops: Callable[[int, int], bool] | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Walk the tree from the root, reading the scores [V] of the nodes on the accepted path only, in order
    (`node_scores(node, accepted nodes so far)`): greedy follows the child holding the argmax; sampling as
    `sample_accept`. `stops(accepted count, token)` ends the walk at an accepted token the sequence stops at (its
    bonus token, never committed, is then that token again, read from no scores). Returns the accepted node ids
    (root excluded) and the bonus token [1]."""
    node, path = 0, []
    while True:
        if path and stops is not None and stops(len(path), int(tree.tokens[path[-1]])):
            return torch.tensor(path, dtype=torch.long, device=tree.tokens.device), tree.tokens[path[-1]][None]
        scores = node_scores(node, path)
        accepted = None
        if do_sample:
            residual = scores.float().softmax(-1)
            for child in tree.children_of(node).tolist():
                token = tree.tokens[child]
                draw = torch.rand((), device=residual.device, generator=generator)
                if draw * residual.sum() < residual[token]:
                    accepted = child
                    break
                residual[token] = 0.0
            if accepted is None:
                bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator)
        else:
            pick = scores.argmax(-1, keepdim=True)
            children = tree.children_of(node)
            match = children[tree.tokens[children] == pick.to(tree.tokens.device)].tolist()
            accepted, bonus = (match[0] if match else None), pick
        if accepted is None:
            return torch.tensor(path, dtype=torch.long, device=tree.tokens.device), bonus
        path.append(accepted)
        node = accepted


def kept_rows(
    kept: list[list[int]], index: torch.LongTensor, processed: torch.Tensor, raw: torch.Tensor, with_raw: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K, V] float32 processed scores (and raw logits where `with_raw`, else the scores again) of each row's
    kept nodes `index` [B, K]: a slice where every row kept a prefix of its nodes (a plain step, a chain accepted
    whole; a shorter row's entries past its own are never read), else a gather."""
    if all(nodes == list(range(len(nodes))) for nodes in kept):
        width = index.shape[1]
        scores = processed[:, :width].float()
        return scores, raw[:, :width].float() if with_raw else scores
    rows_index = index.to(processed.device)[..., None].expand(-1, -1, processed.shape[-1])
    scores = processed.gather(1, rows_index).float()
    return scores, raw.gather(1, rows_index).float() if with_raw else scores
