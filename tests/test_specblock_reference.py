"""SpecBlock against what the reference code computed (github shiweijiezero/SpecBlock), frozen into
tests/reference/fixtures by tests/reference/make_specblock_fixtures.py (rerun it on a checkout of the reference to
refresh them; the commit is in manifest.json).

The drafter the reference wrote with its own `save_pretrained` loads here; block 1, the training-time follow-up
blocks (inherited slot states, rotary positions, the masks over earlier blocks' keys), the inference harness's rank
logits, this package's `specblock_reference` export and the draft-loss terms are compared (float32, 1e-5). Where
this package departs from the reference on purpose, the test pins the departure.
"""

from __future__ import annotations

import copy
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.generation.tree import HostTree
from transformers_specblock.models.specblock.modeling_specblock import block_causal_mask
from transformers_specblock.training.arguments import SpecBlockLossConfig
from transformers_specblock.training.losses import (
    block_terms,
    followup_training_mask,
    rank_head_loss,
    reference_rank_loss,
)
from transformers_specblock.training.modeling import SpecBlockDraftModelForTraining

FIXTURES = Path(__file__).parent / "reference" / "fixtures"
TOL = dict(rtol=0.0, atol=1e-5)



@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((FIXTURES / "manifest.json").read_text())


@pytest.fixture(scope="module")
def modeling() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "modeling.safetensors")


@pytest.fixture(scope="module")
def training() -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / "training.safetensors")


@pytest.fixture(scope="module")
def target(manifest):
    """A tiny Llama target of the fixtures' sizes whose input embedding is the one the reference drafter read."""
    sizes = manifest["sizes"]
    config = LlamaConfig(
        hidden_size=sizes["hidden"], intermediate_size=sizes["intermediate"], num_hidden_layers=4,
        num_attention_heads=sizes["heads"], num_key_value_heads=sizes["kv_heads"], vocab_size=sizes["vocab"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(load_file(FIXTURES / "target_embedding.safetensors")["weight"])
    return model


@pytest.fixture(scope="module")
def drafter(target):
    return SpecBlockDraftModel.from_pretrained(FIXTURES / "reference_drafter", target=target).eval()


def test_fixtures_record_the_reference_commit(manifest):
    assert len(manifest["commit"]) == 40 and manifest["reference"] == "github.com/shiweijiezero/SpecBlock"


def test_block1_equals_the_reference(drafter, modeling, one_thread):
    features, ids = modeling["inputs.features"], modeling["inputs.input_ids"]
    with torch.no_grad():
        out = drafter(ids, features)
    torch.testing.assert_close(out.logits, modeling["block1.logits"], **TOL)
    torch.testing.assert_close(out.rank_logits, modeling["block1.rank_logits"], **TOL)
    torch.testing.assert_close(out.hidden_states, modeling["block1.hidden"], **TOL)
    assert torch.equal(block_causal_mask(ids.shape[1], 4, 0, "cpu"), modeling["block1.mask"])


def reference_followups(drafter, modeling, ms):
    """Our `draft_blocks` chained as the reference's training pass chains its blocks: condition = slot M-1's pre-norm
    state, token = the one M further, block 1's rotary positions, and the reference's masks with its KV layout
    ([block 1 (cross), earlier blocks (ttt), current]) folded onto our cache (block 1 once, then each later block)."""
    features, ids = modeling["inputs.features"], modeling["inputs.input_ids"]
    num_pos, k_slots = ids.shape[1], drafter.config.block_size
    width = num_pos * k_slots
    positions = torch.arange(1, num_pos + 1)[None]
    cache = DynamicCache()
    hidden = drafter.draft_blocks(
        drafter.project_condition(features), ids, positions, block_causal_mask(num_pos, k_slots, 0, "cpu")[None], cache
    ).hidden_states
    outputs = []
    for b, m in enumerate(ms, start=2):
        mask = modeling[f"block{b}.mask"]
        cross, earlier, own = mask[:, :width], mask[:, width:-width], mask[:, -width:]
        earlier = earlier.clone()
        earlier[:, :width] |= cross  # block 1's keys: earlier positions (cross) and its own position (ttt)
        out = drafter.draft_blocks(hidden[:, :, m - 1], modeling[f"block{b}.input_ids"], positions,
                                   torch.cat([earlier, own], dim=1)[None], cache)  # fmt: skip
        outputs.append(out)
        hidden = out.hidden_states
    return outputs


def test_training_time_followup_blocks_equal_the_reference(drafter, modeling, manifest, one_thread):
    """Inherited slot states through `condition_norm` (no `condition_proj`), the layer shift, block 1's rotary
    positions and attention over block 1's and earlier blocks' keys: blocks 2 and 3 as the reference trains them."""
    with torch.no_grad():
        outputs = reference_followups(drafter, modeling, manifest["followup_m"])
    for b, out in enumerate(outputs, start=2):
        torch.testing.assert_close(out.hidden_states, modeling[f"block{b}.hidden"], **TOL)
        torch.testing.assert_close(out.logits, modeling[f"block{b}.logits"], **TOL)
        torch.testing.assert_close(out.rank_logits, modeling[f"block{b}.rank_logits"], **TOL)


def test_our_training_mask_is_the_reference_mask_without_the_current_blocks_earlier_positions(modeling, manifest):
    """The reference's training mask lets a follow-up block's query see that block's entries at earlier positions
    (no counterpart in a drafted tree, where each follow-up block is its own branch); ours does not. Everything else
    (block 1's earlier positions, slots 0..M-1 of each earlier block at the same position, own slots 0..k) agrees."""
    ms = manifest["followup_m"]
    num_pos, k_slots = modeling["inputs.input_ids"].shape[1], 4
    width = num_pos * k_slots
    pos = torch.arange(num_pos).repeat_interleave(k_slots)
    current_earlier = pos[None, :] < pos[:, None]
    for b in range(2, 2 + len(ms)):
        mask = modeling[f"block{b}.mask"]
        folded = torch.cat([mask[:, width : 2 * width] | mask[:, :width], mask[:, 2 * width :]], dim=1)
        ours = followup_training_mask(num_pos, k_slots, ms[: b - 1], "cpu")
        assert torch.equal(ours[:, :-width], folded[:, :-width])
        assert torch.equal(ours[:, -width:], folded[:, -width:] & ~current_earlier)
        assert (folded[:, -width:] & current_earlier).any()


def test_training_runs_followup_blocks_at_the_drafters_positions(target, one_thread):
    """A drafter whose follow-up blocks draft at block 1's positions (`followup_positions="block1"`, as every
    reference checkpoint loads) is trained at those positions too, as the reference trains it."""
    trained = SpecBlockDraftModelForTraining.from_pretrained(FIXTURES / "reference_drafter", target=target)
    assert trained.config.followup_positions == "block1"
    seen = []
    draft_blocks = trained.draft_blocks

    def record(*args, **kwargs):
        seen.append(args[2].clone())
        return draft_blocks(*args, **kwargs)

    trained.draft_blocks = record
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 9), generator=generator)
    trained(
        ids, torch.ones_like(ids), torch.ones_like(ids), torch.randn(1, 9, 192, generator=generator),
        torch.randn(1, 9, 128, generator=generator), torch.randint(0, 256, (1, 9), generator=generator), (2, 3),
    )  # fmt: skip
    # follow-up blocks run only where one of their slots counts (here the first positions: the last ones have no
    # tokens far enough ahead), at block 1's rotary positions there
    assert len(seen) == 3 and all(torch.equal(p, seen[0][:, : p.shape[1]]) for p in seen[1:])
    trained.config.followup_positions = "start_node"
    seen.clear()
    trained(
        ids, torch.ones_like(ids), torch.ones_like(ids), torch.randn(1, 9, 192, generator=generator),
        torch.randn(1, 9, 128, generator=generator), torch.randint(0, 256, (1, 9), generator=generator), (2, 3),
    )  # fmt: skip
    first, second = seen[1].shape[1], seen[2].shape[1]
    assert torch.equal(seen[1], seen[0][:, :first] + 2) and torch.equal(seen[2], seen[0][:, :second] + 5)


@pytest.mark.parametrize("top_k", [10, 20])
def test_rank_logits_as_the_inference_harness_reads_them(drafter, modeling, top_k):
    """The harness computes the rank features within the top `RANK_TOPK` logits (default 10; training used 20):
    `rank_feature_top_k` gives either; the predicted classes follow."""
    drafter.config.rank_feature_top_k = top_k
    try:
        with torch.no_grad():
            _, rank_logits = drafter.heads(modeling["block1.hidden"])
    finally:
        drafter.config.rank_feature_top_k = 20
    expected = modeling[f"harness.rank_logits_top{top_k}"]
    torch.testing.assert_close(rank_logits, expected, **TOL)
    assert torch.equal(rank_logits.argmax(-1), expected.argmax(-1))


def test_our_export_loads_in_the_reference_class_with_the_same_outputs(drafter, modeling, tmp_path, one_thread):
    """The script loaded this package's `specblock_reference` export in `LlamaForCausalLMSpecBlock` (all keys but the
    embedding, which the reference never saves) and stored the weights it held and the outputs it computed."""
    drafter.save_pretrained(tmp_path, checkpoint_format="specblock_reference")
    ours = load_file(tmp_path / "model.safetensors")
    theirs = {k[len("export.") :]: v for k, v in modeling.items() if k.startswith("export.") and ".block1." not in k}
    theirs = {k: v for k, v in theirs.items() if not k.startswith("block1.")}
    assert set(ours) == set(theirs)
    for key in ours:
        assert ours[key].shape == theirs[key].shape and torch.equal(ours[key], theirs[key]), key
    for name in ("logits", "rank_logits", "hidden"):
        assert torch.equal(modeling[f"export.block1.{name}"], modeling[f"block1.{name}"])
    config = json.loads((tmp_path / "config.json").read_text())
    reference = json.loads((FIXTURES / "reference_drafter" / "config.json").read_text())
    for field in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "draft_vocab_size", "diffspec_draft_token_num", "rank_classes",
                  "rms_norm_eps"):  # fmt: skip
        assert config[field] == reference[field], field
    mapping = torch.load(tmp_path / "vocab_mapping.pt", weights_only=True)
    assert torch.equal(mapping["d2t"], modeling["export.d2t"]) and torch.equal(mapping["t2d"], modeling["export.t2d"])


# ------------------------------------------------------------------------------------------------ training loss
def our_batch(drafter, training):
    """The reference batch in this package's conventions: tokens x_0..x_S (x_S the reference's 0 padding), features
    per position, the target's logits at position j (= the reference's target[j - 1]) over the draft vocabulary."""
    ids = torch.cat([training["batch.tokens"][:, :1], training["batch.input_ids"]], dim=1)
    target = training["batch.target"]
    logits = torch.cat([torch.zeros_like(target[:, :1]), target], dim=1)
    features = training["batch.hidden_states"]
    features = torch.cat([features, torch.zeros_like(features[:, :1])], dim=1)
    return ids, features, logits[..., drafter.t2d], logits.argmax(-1)


def block_losses(drafter, training, hidden, offset: int, position_mask=None):
    """Per-slot masked mean draft CE (valid prefix) of one block with this package's `block_terms`; with
    `position_mask`, also the reference's extra factor (its block-1 slot-0 position mask at position i)."""
    ids, _, target_logits, argmax = our_batch(drafter, training)
    lookup = torch.full((256,), -1)
    lookup[drafter.d2t] = torch.arange(128)
    ones = torch.ones_like(ids, dtype=torch.bool)
    terms = block_terms(drafter.heads, hidden, target_logits.softmax(-1), lookup[argmax], ones, ones, offset,
                        drafter.config.rank_bucket_upper_bounds, rank_chain_mask=False)  # fmt: skip
    mask = terms.counted & terms.in_vocab & terms.prefix
    if position_mask is not None:
        mask = mask & position_mask.bool()[:, :, None]
    return (terms.ce * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1), terms, mask


def training_hidden(drafter, training, ms):
    """Block 1 and the reference's training-time follow-up blocks on the training batch (reference masks and
    positions, as `reference_followups`)."""
    ids, features = training["batch.input_ids"], training["batch.hidden_states"]
    batch, num_pos = ids.shape
    k_slots, width = 4, ids.shape[1] * 4
    positions = torch.arange(1, num_pos + 1).expand(batch, -1)
    cache = DynamicCache()
    hidden = drafter.draft_blocks(drafter.project_condition(features), ids, positions,
                                  block_causal_mask(num_pos, k_slots, 0, "cpu")[None], cache).hidden_states  # fmt: skip
    hiddens, offset = [hidden], 0
    pos = torch.arange(num_pos).repeat_interleave(k_slots)
    for b, m in enumerate(ms, start=1):
        offset += m
        token_idx = (torch.arange(num_pos) + offset).clamp(max=num_pos - 1)
        mask = followup_training_mask(num_pos, k_slots, list(ms[:b]), "cpu")
        mask[:, -width:] |= pos[None, :] < pos[:, None]  # the reference's block also sees its earlier positions
        out = drafter.draft_blocks(hidden[:, :, m - 1], ids[:, token_idx], positions, mask[None], cache)
        hidden = out.hidden_states
        hiddens.append(hidden)
    return hiddens


def test_draft_loss_terms_equal_the_reference(drafter, training, manifest, one_thread):
    """Soft CE against the target's draft-vocabulary softmax, per slot, over the valid prefix (slots 0..k-1 top-1
    right), target argmax inside the draft vocabulary: block 1 and both follow-up blocks, slot by slot. The reference
    also gates a follow-up block's slots at position i by its block-1 slot-0 position mask (target argmax of
    position i+1 in the draft vocabulary); ours does not (pinned: it changes block 2's slot-0 term here)."""
    ms = manifest["followup_m"]
    with torch.no_grad():
        hiddens = training_hidden(drafter, training, ms)
    position_mask = training["position_mask"]
    offsets = [0, ms[0], ms[0] + ms[1]]
    for b, (hidden, offset) in enumerate(zip(hiddens, offsets), start=1):
        ours, _, _ = block_losses(drafter, training, hidden, offset, position_mask)
        torch.testing.assert_close(ours, training[f"block{b}.draft_losses"], **TOL)
    ungated, _, _ = block_losses(drafter, training, hiddens[1], offsets[1])
    assert (ungated - training["block2.draft_losses"]).abs().max() > 1e-3
    total = sum(training[f"block{b}.draft_losses"] for b in (1, 2, 3))
    torch.testing.assert_close(total, training["loss.draft_per_slot"], **TOL)  # summed over blocks, not averaged


def test_rank_labels_equal_the_reference_and_the_rank_loss_differs(drafter, training, one_thread):
    """Rank classes (rank 1 / 2-4 / 5-10 / >10 of the target's token in the slot's draft distribution) agree
    wherever the target's argmax lies in the draft vocabulary. The rank-head loss is this package's own (class
    weights, neighbour smoothing, expected distance) and differs from the reference's (per-slot min(1, 10/count)
    weights, kernel smoothing, distance to the predicted class, chain cut at the first wrong rank prediction)."""
    with torch.no_grad():
        hidden = training_hidden(drafter, training, [])[0]
    _, terms, _ = block_losses(drafter, training, hidden, 0)
    theirs = training["block1.rank_labels"]
    rows = (terms.counted & terms.prefix & terms.in_vocab) & (theirs >= 0)
    assert rows.sum() >= 20
    assert torch.equal(terms.labels[rows], theirs[rows])
    assert set(theirs[rows].tolist()) >= {0, 1, 2, 3}
    with torch.no_grad():
        _, rank_logits = drafter.heads(hidden)
    rank_sum, weight = rank_head_loss(rank_logits, terms.labels, terms.counted & terms.prefix)
    ours = (rank_sum / weight).item()
    assert abs(ours - training["block1.rank_loss"].item()) > 0.1


def test_reference_rank_loss_equals_the_reference_block_by_block(drafter, training, manifest, one_thread):
    """`reference_rank_loss` (rank chain cut after the first wrong class prediction, per-slot min(1, 10 / count)
    class weights, kernel ordinal smoothing, distance to the predicted class) on our rank logits and labels gives
    the reference's rank loss of each block; its follow-up blocks start their chains where block 1's slot 0 counts."""
    ms = manifest["followup_m"]
    with torch.no_grad():
        hiddens = training_hidden(drafter, training, ms)
    start = training["position_mask"].bool()
    for b, (hidden, offset) in enumerate(zip(hiddens, [0, ms[0], ms[0] + ms[1]]), start=1):
        _, terms, _ = block_losses(drafter, training, hidden, offset)
        with torch.no_grad():
            _, rank_logits = drafter.heads(hidden)
        valid = terms.counted & terms.in_vocab
        labels = torch.where(valid, terms.labels, 0)
        ours = reference_rank_loss(rank_logits, labels, valid, start & valid[..., 0] if b == 1 else start, 10)
        torch.testing.assert_close(ours, training[f"block{b}.rank_loss"], **TOL)


def test_one_training_step_equals_the_reference(target, training, manifest, tmp_path, one_thread):
    """Block 1 with the reference's rank loss, the reference's optimizer settings (AdamW betas (0.9, 0.95), no weight
    decay, gradient norm clipped to 0.5): the same loss and, after one step, the same weights."""
    step = manifest["step"]
    trained = SpecBlockDraftModelForTraining.from_pretrained(FIXTURES / "reference_drafter", target=target)
    trained.loss_config = SpecBlockLossConfig(rank_loss_form="reference", rank_budget_per_class=10)
    ids, features, target_logits, argmax = our_batch(trained, training)
    ones = torch.ones_like(ids)
    out = trained(ids, ones, ones, features, target_logits, argmax, (), training_step=0)
    torch.testing.assert_close(out.loss, training["step.loss"], **TOL)
    out.loss.backward()
    params = [p for p in trained.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, step["max_grad_norm"])
    assert abs(norm.item() - step["grad_norm_before_clipping"]) < 1e-4
    optimizer = torch.optim.AdamW(params, lr=step["lr"], betas=tuple(step["betas"]), weight_decay=0.0)
    optimizer.step()
    trained.save_pretrained(tmp_path, checkpoint_format="specblock_reference")
    ours = load_file(tmp_path / "model.safetensors")
    theirs = {k[len("step.") :]: v for k, v in training.items() if k.startswith("step.")}
    theirs = {k: v for k, v in theirs.items() if k not in ("draft_per_slot", "rank", "loss")}
    assert set(ours) == set(theirs)
    before = load_file(FIXTURES / "reference_drafter" / "model.safetensors")
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], **TOL, msg=key)
        if key not in ("d2t", "t2d"):  # Adam's first step moves almost every weight by +-lr: compare the moves
            moved = (ours[key] - before[key]) - (theirs[key] - before[key])
            assert moved.abs().max() <= 0.05 * step["lr"], key
            assert (theirs[key] - before[key]).abs().max() > 0.9 * step["lr"], key


# ------------------------------------------------------------------------------------------------ trees
def test_pruning_keeps_the_nodes_the_reference_keeps(manifest):
    """The harness prunes a drafted tree to its budget by cumulative draft log-prob, adding each node with its
    missing ancestors while they fit (`_prune_tree_np`); ours keeps the best path scores. On trees whose scores fall
    along every path (drafted trees') both keep the same nodes."""
    trees = load_file(FIXTURES / "trees.safetensors")
    for case, budget in enumerate(manifest["pruning_budgets"]):
        tree = HostTree.root_only()
        for node, (parent, score) in enumerate(zip(trees[f"prune{case}.parents"].tolist(),
                                                   trees[f"prune{case}.lps"].tolist())):  # fmt: skip
            tree.add_node(node, parent + 1, score)
        kept = sorted(tree.prune(budget).tokens[1:])
        assert kept == trees[f"prune{case}.kept"].tolist(), case


def paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node as the tuple of tokens from the root's child down to it (parents: -1 = the root)."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return set(out)


def harness_widths(probs: list[float], classes: list[int], beam_width: int = 10) -> list[int]:
    """Candidates per slot of a harness block-1 tree at its defaults. Slot 0: 3 / 5 / 8 / beam width by its greedy
    probability (>= 0.9 / 0.8 / 0.6 / below; `ADAPTIVE_SLOT0=1`), whatever its rank class. Slot k >= 1: "slim_r2"
    [2, 4, 6, 4][class], at most 2 / 3 when the greedy probability is >= 0.95 / 0.85 (`ADAPTIVE_ALL=1`)."""
    p0 = probs[0]
    widths = [min(3, beam_width) if p0 >= 0.9 else min(5, beam_width) if p0 >= 0.8 else
              min(8, beam_width) if p0 >= 0.6 else beam_width]  # fmt: skip
    for p, c in zip(probs[1:], classes[1:]):
        base = [2, 4, 6, 4][c]
        widths.append(min(2, base) if p >= 0.95 else min(3, base) if p >= 0.85 else base)
    return widths


def test_block1_tree_is_the_reference_tree_but_for_slot_0(drafter, manifest):
    """Block 1 of a tree at the harness's defaults: the greedy chain of K nodes and, at every slot, its top candidates
    under the previous slot's greedy node, as many as `harness_widths` says. Ours (`branch_widths` (2, 4, 6, 4), the
    harness's rank features: top 10) drafts `branch_widths[class]` at every slot: the same nodes wherever the two
    widths agree, a prefix of the same ranking elsewhere - slot 0 (the harness ignores its rank class there) and the
    confident slots the harness narrows."""
    from numpy import zeros

    from transformers_specblock.generation.candidate_generators.specblock import SpecBlockCandidateGenerator

    trees = load_file(FIXTURES / "trees.safetensors")
    drafter.config.rank_feature_top_k = 10
    agree = differ = 0
    try:
        generator = SpecBlockCandidateGenerator(drafter, tree_budget=90, max_blocks=1)
        head = drafter.lm_head.weight.detach().clone()
        for case, scale in enumerate(manifest["block1_trees"]["lm_head_scales"]):
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head * scale)
                out = drafter(trees[f"tree{case}.input_ids"], trees[f"tree{case}.features"])
                drafter.lm_head.weight.copy_(head)
            logits, hidden, rank = out.logits[0, -1:], out.hidden_states[0, -1:], out.rank_logits[0, -1:]
            tree = HostTree.root_only()
            generator._expand(tree, generator._read_round(logits, hidden, rank, [0], zeros((1, 0), dtype=bool)))
            ours = paths(tree.tokens[1:], [p - 1 for p in tree.parents[1:]])
            theirs = paths(trees[f"tree{case}.tokens"].tolist(), trees[f"tree{case}.parents"].tolist())
            classes = rank[0].argmax(-1).tolist()
            expected = harness_widths(logits[0].softmax(-1).max(-1).values.tolist(), classes)
            for slot in range(4):
                mine, yours = {p for p in ours if len(p) == slot + 1}, {p for p in theirs if len(p) == slot + 1}
                assert len(yours) == expected[slot] and len(mine) == drafter.generation_config.branch_widths[classes[slot]]
                assert mine <= yours if len(mine) <= len(yours) else yours <= mine
                agree, differ = agree + (mine == yours), differ + (mine != yours)
    finally:
        drafter.config.rank_feature_top_k = 20
    assert agree and differ  # both kinds of slot occur in the fixtures


@pytest.mark.parametrize("case", [0, 1])
def test_followup_blocks_while_drafting_equal_the_harness(drafter, manifest, case, one_thread):
    """The harness's own inference model drafted a round of follow-up blocks after 5 context positions and the first
    drafted one: each starts from a block-1 slot's pre-norm state and token, sees the committed context and block 1's
    slots up to its start slot, at block 1's rotary positions. Our cache, block 1 and `draft_blocks` under
    `followup_block_mask` give the same logits, rank logits (harness features: top 10) and slot states."""
    from numpy import arange

    from transformers_specblock.generation.candidate_generators.specblock import SpecBlockCandidateGenerator
    from transformers_specblock.models.specblock.modeling_specblock import followup_block_mask

    trees = load_file(FIXTURES / "trees.safetensors")
    scale = manifest["followup_rounds"]["lm_head_scales"][case]
    p = f"round{case}."
    head = drafter.lm_head.weight.detach().clone()
    drafter.config.rank_feature_top_k = 10
    try:
        with torch.no_grad():
            drafter.lm_head.weight.copy_(head * scale)
            generator = SpecBlockCandidateGenerator(drafter, tree_budget=90, max_blocks=2)
            generator.observe(trees[p + "features"][0], trees[p + "input_ids"][0], 1)
            logits, hidden, rank = generator.root_block
            torch.testing.assert_close(logits, trees[p + "block1.logits"], **TOL)
            torch.testing.assert_close(rank, trees[p + "block1.rank_logits"], **TOL)
            torch.testing.assert_close(hidden, trees[p + "block1.hidden"], **TOL)
            seen = trees[p + "seen_block1_slots"]
            torch.testing.assert_close(trees[p + "start_states"], hidden[0, seen - 1], **TOL)  # slot s starts it
            inherited = arange(4)[None, :] < seen.numpy()[:, None]
            num = len(seen)
            positions = torch.tensor([generator.drafter.followup_start_positions(generator.root_position, [0] * num)])
            mask = followup_block_mask(inherited, 4, generator.committed_entries - 4, "cpu")
            out = drafter.draft_blocks(trees[p + "start_states"][None], trees[p + "start_tokens"][None], positions,
                                       mask, generator.cache)  # fmt: skip
            drafter.lm_head.weight.copy_(head)
    finally:
        drafter.lm_head.weight.data.copy_(head)
        drafter.config.rank_feature_top_k = 20
    torch.testing.assert_close(out.logits[0], trees[p + "logits"], **TOL)
    torch.testing.assert_close(out.rank_logits[0], trees[p + "rank_logits"], **TOL)
    torch.testing.assert_close(out.hidden_states[0], trees[p + "hidden"], **TOL)


def test_two_block_trees_share_the_nodes_docs_state(drafter, manifest, one_thread):
    """Two block steps pruned to 90 nodes, on the rounds above: the harness starts a follow-up block from every
    branching slot's greedy node and every sibling of block 1 (24 and 20 blocks); ours from the best
    `max_followups` (4) siblings / chain ends that could survive pruning. The trees share 39 and 49 of their 90 nodes
    (the numbers docs/design.md states; 48 and 61 with `max_followups` 64)."""
    from transformers_specblock.generation.candidate_generators.specblock import SpecBlockCandidateGenerator

    trees = load_file(FIXTURES / "trees.safetensors")
    head = drafter.lm_head.weight.detach().clone()
    drafter.config.rank_feature_top_k = 10
    shared = {}
    try:
        for case, scale in enumerate(manifest["followup_rounds"]["lm_head_scales"]):
            p = f"round{case}."
            for followups in (4, 64):
                with torch.no_grad(), drafter.tree_settings(max_followups=followups):
                    drafter.lm_head.weight.copy_(head * scale)
                    generator = SpecBlockCandidateGenerator(drafter, tree_budget=90, max_blocks=2)
                    generator.observe(trees[p + "features"][0], trees[p + "input_ids"][0], 1)
                    tree = generator.grow_tree(trees[p + "input_ids"][0, -1:]).prune(90)
                ours = paths(tree.tokens[1:], [q - 1 for q in tree.parents[1:]])
                theirs = paths(trees[p + "tree.tokens"].tolist(), trees[p + "tree.parents"].tolist())
                assert len(tree) - 1 == len(trees[p + "tree.tokens"]) == 90
                shared[case, followups] = len(ours & theirs)
    finally:
        drafter.lm_head.weight.data.copy_(head)
        drafter.config.rank_feature_top_k = 20
    assert shared == {(0, 4): 39, (0, 64): 48, (1, 4): 49, (1, 64): 61}


# ------------------------------------------------------------------------------------------------ decoding
def test_greedy_decoding_commits_what_the_harness_commits(target, manifest, one_thread):
    """A drafter the reference's own training code trained on the tiny target (300 steps), saved by its
    `save_pretrained`: the harness's greedy loop (two block steps, 90 tree tokens) and `generate` with it here
    (`tree_budget` 90, `max_blocks` 2, rank features over the top 10 as the harness computes them) both commit the
    target's own greedy tokens. Step by step they commit the same counts until the trees differ (slot 0, follow-up
    starts: see the tree tests), from step 2 to 16 of about 20; there the harness commits 4 where ours commits 5.
    tau over 6 prompts x 40 tokens: harness 1.919, ours 2.036."""
    decoding = load_file(FIXTURES / "decoding.safetensors")
    drafter = SpecBlockDraftModel.from_pretrained(FIXTURES / "decoding_drafter", target=target).eval()
    drafter.config.rank_feature_top_k = 10
    theirs_tau, ours_tau, per_step = [], [], []
    for row, prompt in enumerate(decoding["prompts"]):
        committed = decoding[f"prompt{row}.tokens"]
        plain = target.generate(prompt[None], do_sample=False, max_new_tokens=len(committed))[0, len(prompt) :]
        assert torch.equal(plain, committed)
        with drafter.tree_settings(tree_budget=90, max_blocks=2):  # loaded: max_blocks = num_ttt_blocks (3)
            ours = target.generate(prompt[None], assistant_model=drafter, do_sample=False,
                                   max_new_tokens=len(committed))  # fmt: skip
        per_step.append((decoding[f"prompt{row}.per_iteration"].tolist(), drafter.last_stats.accepted_per_iteration))
        assert torch.equal(ours[0, len(prompt) :], committed)
        theirs_tau.append(decoding[f"prompt{row}.per_iteration"].float().mean().item())
        ours_tau.append(drafter.last_stats.tau)
    assert round(sum(theirs_tau) / len(theirs_tau), 3) == round(manifest["decoding"]["harness_tau"], 3) == 1.919
    assert round(sum(ours_tau) / len(ours_tau), 3) == 2.036
    leading = [next((i for i, (a, b) in enumerate(zip(t, o)) if a != b), min(len(t), len(o))) for t, o in per_step]
    assert leading == [11, 5, 16, 8, 5, 2]  # identical committed counts, step by step, before the first difference


def test_reference_rank_loss_form_trains_every_block(target, training, one_thread):
    """`rank_loss_form="reference"` over three blocks: a finite loss whose rank part reaches the rank head; an unknown
    form is refused."""
    trained = SpecBlockDraftModelForTraining.from_pretrained(FIXTURES / "reference_drafter", target=target)
    trained.loss_config = SpecBlockLossConfig(rank_loss_form="reference")
    ids, features, target_logits, argmax = our_batch(trained, training)
    ones = torch.ones_like(ids)
    out = trained(ids, ones, ones, features, target_logits, argmax, (2, 3), training_step=0)
    assert torch.isfinite(out.loss) and out.loss_rank > 0
    out.loss_rank.backward()
    assert trained.rank_head[0].weight.grad.abs().sum() > 0 and trained.lm_head.weight.grad is None
    with pytest.raises(ValueError, match="rank_loss_form must be one of"):
        SpecBlockLossConfig(rank_loss_form="paper")


# ------------------------------------------------------------------------------------------------ reference trees
def reference_generator(drafter, max_blocks: int):
    from transformers_specblock.generation.candidate_generators.specblock import SpecBlockCandidateGenerator

    with drafter.tree_settings(tree_construction="reference"):
        return SpecBlockCandidateGenerator(drafter, tree_budget=90, max_blocks=max_blocks)


def test_reference_block1_trees_are_the_harness_trees(drafter, manifest):
    """`tree_construction="reference"`: block 1 (one block step) at the harness's defaults is the harness's tree,
    node for node (paths from the root), on all 10 fixture trees - confident slots narrowed, slot 0 by probability."""
    trees = load_file(FIXTURES / "trees.safetensors")
    drafter.config.rank_feature_top_k = 10
    head = drafter.lm_head.weight.detach().clone()
    try:
        for case, scale in enumerate(manifest["block1_trees"]["lm_head_scales"]):
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head * scale)
                out = drafter(trees[f"tree{case}.input_ids"], trees[f"tree{case}.features"])
            generator = reference_generator(drafter, max_blocks=1)
            generator.root_block = (out.logits[:, -1], out.hidden_states[:, -1], out.rank_logits[:, -1])
            tree = generator.grow_tree(trees[f"tree{case}.input_ids"][0, -1:])
            theirs = trees[f"tree{case}.tokens"].tolist(), trees[f"tree{case}.parents"].tolist()
            assert paths(tree.tokens[1:], [p - 1 for p in tree.parents[1:]]) == paths(*theirs), case
            assert len(tree) - 1 == len(theirs[0]), case  # block 1 holds no equal siblings
    finally:
        drafter.lm_head.weight.data.copy_(head)
        drafter.config.rank_feature_top_k = 20


def test_reference_two_block_trees_are_the_harness_trees(drafter, manifest, one_thread):
    """`tree_construction="reference"`, two block steps pruned to 90 nodes, on the rounds the harness's own inference
    model drafted (24 and 20 follow-up blocks): the same blocks, nodes and parents (paths). The harness's 90 nodes may
    hold equal siblings (a follow-up block from a mid-chain greedy node can repeat block 1's next slot: one pair in
    the second round); ours merges them."""
    trees = load_file(FIXTURES / "trees.safetensors")
    head = drafter.lm_head.weight.detach().clone()
    drafter.config.rank_feature_top_k = 10
    sizes = []
    try:
        for case, scale in enumerate(manifest["followup_rounds"]["lm_head_scales"]):
            p = f"round{case}."
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head * scale)
                generator = reference_generator(drafter, max_blocks=2)
                generator.observe(trees[p + "features"][0], trees[p + "input_ids"][0], 1)
                tree = generator.grow_tree(trees[p + "input_ids"][0, -1:])
            theirs = paths(trees[p + "tree.tokens"].tolist(), trees[p + "tree.parents"].tolist())
            assert paths(tree.tokens[1:], [q - 1 for q in tree.parents[1:]]) == theirs, case
            assert len(tree) - 1 == len(theirs)
            sizes.append((len(trees[p + "tree.tokens"]), len(theirs), generator.stats.blocks_per_iteration[-1]))
    finally:
        drafter.lm_head.weight.data.copy_(head)
        drafter.config.rank_feature_top_k = 20
    assert sizes == [(90, 90, 25), (90, 89, 21)]  # harness nodes, distinct paths, blocks (1 + 24 and 1 + 20)


@pytest.mark.parametrize("budget", [4, 8, 16, 32])
def test_reference_last_round_drafts_only_what_pruning_can_keep(drafter, manifest, budget, monkeypatch, one_thread):
    """The last round of follow-up blocks drafts only the blocks, and slots, that could place a node in the tree pruned
    to `tree_budget`: on the fixture rounds, the same tree (paths) as drafting every block the harness drafts, from
    fewer blocks wherever block 1 already fills the budget."""
    from transformers_specblock.generation.tree import HostTree

    trees = load_file(FIXTURES / "trees.safetensors")
    head = drafter.lm_head.weight.detach().clone()
    drafter.config.rank_feature_top_k = 10

    def grow(case: int) -> tuple[set, int]:
        p = f"round{case}."
        with torch.no_grad():
            generator = reference_generator(drafter, max_blocks=2)
            generator.tree_budget = budget
            generator.observe(trees[p + "features"][0], trees[p + "input_ids"][0], 1)
            tree = generator.grow_tree(trees[p + "input_ids"][0, -1:])
        return paths(tree.tokens[1:], [q - 1 for q in tree.parents[1:]]), generator.stats.blocks_per_iteration[-1]

    try:
        for case, scale in enumerate(manifest["followup_rounds"]["lm_head_scales"]):
            with torch.no_grad():
                drafter.lm_head.weight.copy_(head * scale)
            narrowed, blocks = grow(case)
            with monkeypatch.context() as patch:  # every start has room: the harness's round
                patch.setattr(HostTree, "room_below", lambda self, scores, budget: [budget] * len(scores))
                every, all_blocks = grow(case)
            assert narrowed == every and len(every) == budget, case
            assert blocks < all_blocks if budget < 25 else blocks <= all_blocks, (case, blocks, all_blocks)
    finally:
        drafter.lm_head.weight.data.copy_(head)
        drafter.config.rank_feature_top_k = 20


def test_reference_trees_decode_losslessly_and_the_drafter_inputs_differ_from_the_harness(target, manifest, one_thread):
    """The fixture's greedy decoding with `tree_construction="reference"` (two block steps, 90 tree tokens, set for
    the call only) and this package's context feeding: the target's own greedy tokens. Not step for step the
    harness's: its loop feeds the drafter differently (`context_feeding="reference"` does it its way, and then every
    step is the same: tests/test_specblock_reference_feeding.py), so block 1's logits already differ at the first
    step (by 0.018 here) although the trees from the same block outputs are the same (tests above)."""
    decoding = load_file(FIXTURES / "decoding.safetensors")
    drafter = SpecBlockDraftModel.from_pretrained(FIXTURES / "decoding_drafter", target=target).eval()
    drafter.config.rank_feature_top_k = 10
    taus, leading = [], []
    for row, prompt in enumerate(decoding["prompts"]):
        committed = decoding[f"prompt{row}.tokens"]
        with drafter.tree_settings(max_blocks=2):
            out = target.generate(prompt[None], assistant_model=drafter, do_sample=False, tree_budget=90,
                                  max_new_tokens=len(committed), tree_construction="reference")  # fmt: skip
        assert torch.equal(out[0, len(prompt) :], committed)
        theirs, ours = decoding[f"prompt{row}.per_iteration"].tolist(), drafter.last_stats.accepted_per_iteration
        leading.append(next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours))))
        taus.append(drafter.last_stats.tau)
    assert drafter.generation_config.tree_construction == "package"
    # the same accepted counts as the harness's loop for the first 22 / 10 / 23 / 18 / 18 / 24 steps (with this
    # package's trees: 11 / 5 / 16 / 8 / 5 / 2); tau 1.912 against the harness's 1.919 (ours with its own trees: 2.036)
    assert leading == [22, 10, 23, 18, 18, 24] and round(sum(taus) / len(taus), 3) == 1.912


def test_tree_construction_is_checked(drafter, target):
    """An unknown construction is refused by name; a drafter without a reference construction refuses "reference";
    reference trees adapt online, the reference harness's context feeding does not."""
    from transformers_specblock import Eagle3DraftModel
    from transformers_specblock.models.tree_drafter.generation_config import TreeGenerationConfig

    with pytest.raises(ValueError, match="tree_construction must be one of"):
        TreeGenerationConfig(tree_construction="paper")
    with pytest.raises(ValueError, match="grows trees with tree_construction in"):
        Eagle3DraftModel.from_target(target, tree_budget=8).set_drafting_settings(tree_construction="reference")
    with drafter.tree_settings(tree_construction="reference", online_adaptation="always"):
        assert drafter.generation_config.online_adaptation == "always"
    with pytest.raises(ValueError, match="without online adaptation"):
        drafter.set_drafting_settings(context_feeding="reference", tree_budget=8, online_adaptation="always")
    with drafter.tree_settings(tree_construction="reference"):
        assert drafter.generation_config.tree_construction == "reference"
    assert drafter.generation_config.tree_construction == "package"


@pytest.mark.slow  # loads the packaged SmolLM2-135M-Instruct
def test_smollm2_decoding_accepts_what_the_harness_accepted(one_thread):
    """SmolLM2-135M-Instruct, float32 greedy, a drafter derived from the shipped SpecBlock one (the package's own copy,
    whose sha256 the fixture records) so that the reference can represent it (`tests/reference/smollm2_decoding.py`:
    rank-head biases dropped, top-1 rank feature within the top 20, follow-ups at block 1's positions), passed through
    the reference layout and loaded back. The harness's
    greedy loop (frozen: `fixtures/smollm2_decoding.json`, written by that script: each prompt set's first prompt and
    HumanEval's third) and
    `generate` with `tree_construction="reference"` and `context_feeding="reference"` accept the same number of
    tokens at every step, and ours is the target's greedy."""
    import sys

    from transformers_specblock import load_packaged_model, load_prompts

    sys.path.insert(0, str(Path(__file__).parent / "reference"))
    from smollm2_decoding import FROZEN_DRAFTER, drafter_sha256, reference_compatible

    frozen = json.loads((FIXTURES / "smollm2_decoding.json").read_text())
    assert frozen["drafter_sha256"] == drafter_sha256(), (
        "The shipped SpecBlock drafter changed since fixtures/smollm2_decoding.json was written: rerun "
        "tests/reference/smollm2_decoding.py (its docstring has the command) with a SpecBlock reference checkout."
    )
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    target = target.float()
    frozen_drafter = SpecBlockDraftModel.from_pretrained(FROZEN_DRAFTER, target=target, dtype=torch.float32).eval()
    derived = reference_compatible(frozen_drafter)
    derived.bind_target(target)
    folder = Path(tempfile.mkdtemp())
    derived.save_pretrained(folder, checkpoint_format="specblock_reference")
    drafter = SpecBlockDraftModel.from_pretrained(folder, target=target).eval()
    drafter.config.rank_feature_top_k = 10  # the harness's RANK_TOPK
    endless = copy.deepcopy(target.generation_config)
    endless.eos_token_id = None  # as the harness ran (its tokenizer stand-in has no end of sequence)
    for row in frozen["rows"]:
        text = load_prompts(row["prompt_set"], num_prompts=row["index"] + 1, tokenizer=tokenizer)[row["index"]]["text"]
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        mask = torch.ones_like(ids)
        plain = target.generate(ids, attention_mask=mask, generation_config=endless, do_sample=False,
                                max_new_tokens=frozen["max_new_tokens"])  # fmt: skip
        with drafter.tree_settings(max_blocks=2):
            out = target.generate(ids, attention_mask=mask, generation_config=endless, assistant_model=drafter,
                                  do_sample=False, tree_budget=90, max_new_tokens=frozen["max_new_tokens"],
                                  tree_construction="reference", context_feeding="reference")  # fmt: skip
        assert torch.equal(out, plain)
        ours = drafter.last_stats.accepted_per_iteration
        assert ours[:-1] == row["accepted_harness"][: len(ours) - 1], row  # the last step: cut at max_new_tokens
