"""SpecBlock's greedy loop against the SpecBlock reference harness's, step by step, on the tiny decoding fixture
(tests/reference/fixtures/decoding.safetensors, written by tests/reference/make_specblock_fixtures.py from the
harness's own loop): with `tree_construction="reference"` and `context_feeding="reference"` the drafter is fed the
same tokens at the same rotary positions over the same cache, drafts the same block-1 logits, and the loop accepts the
same tokens at every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_specblock_reference import manifest, target  # noqa: F401  (fixtures)
from transformers_specblock import Eagle3DraftModel, SpecBlockDraftModel
from transformers_specblock.generation.candidate_generators.specblock import SpecBlockCandidateGenerator
from transformers_specblock.models.tree_drafter.generation_config import TreeGenerationConfig

FIXTURES = Path(__file__).parent / "reference" / "fixtures"


@pytest.fixture(scope="module")
def decoded(target) -> list[dict]:
    """Per fixture prompt: the harness's record and ours - what each draft fed the drafter (tokens, rotary position
    of the first, cache entries before them, block-1 logits), the accepted counts, the output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on shared cores
    decoding = load_file(FIXTURES / "decoding.safetensors")
    drafter = SpecBlockDraftModel.from_pretrained(FIXTURES / "decoding_drafter", target=target).eval()
    drafter.config.rank_feature_top_k = 10  # as the harness computes rank features
    observe, feed = SpecBlockCandidateGenerator.observe, SpecBlockCandidateGenerator._feed
    log: list[dict] = []

    def spy_feed(self, features, tokens, first_position):
        log[-1]["chunks"].append((tokens.tolist(), first_position, self.committed_entries))
        return feed(self, features, tokens, first_position)

    def spy_observe(self, *args, **kwargs):
        log.append({"chunks": []})
        observe(self, *args, **kwargs)
        log[-1]["logits"] = self.root_block[0][0].clone()

    rows = []
    SpecBlockCandidateGenerator.observe, SpecBlockCandidateGenerator._feed = spy_observe, spy_feed
    try:
        for row, prompt in enumerate(decoding["prompts"]):
            log.clear()
            committed = decoding[f"prompt{row}.tokens"]
            with drafter.tree_settings(max_blocks=2):
                out = target.generate(prompt[None], assistant_model=drafter, do_sample=False, tree_budget=90,
                                      max_new_tokens=len(committed), tree_construction="reference",
                                      context_feeding="reference")  # fmt: skip
            p = f"prompt{row}."
            fed = decoding[p + "fed_tokens"].split(decoding[p + "fed_count"].tolist())
            rows.append({
                "theirs": {"tokens": [t.tolist() for t in fed], "position": decoding[p + "fed_position"].tolist(),
                           "cached": decoding[p + "fed_cached"].tolist(), "logits": decoding[p + "block1_logits"],
                           "accepted": decoding[p + "per_iteration"].tolist(), "output": committed},
                "ours": {"tokens": [sum((c[0] for c in call["chunks"]), []) for call in log],
                         "position": [call["chunks"][0][1] for call in log],
                         "cached": [call["chunks"][0][2] for call in log],
                         "logits": torch.stack([call["logits"] for call in log]),
                         "accepted": drafter.last_stats.accepted_per_iteration, "output": out[0, len(prompt) :],
                         "tau": drafter.last_stats.tau},
            })  # fmt: skip
    finally:
        SpecBlockCandidateGenerator.observe, SpecBlockCandidateGenerator._feed = observe, feed
        torch.set_num_threads(threads)
    return rows


def test_reference_feeding_feeds_the_drafter_what_the_harness_fed(decoded):
    """Every draft of every prompt: the same tokens (the prompt's last position twice; after a step that accepted
    a >= 1 tokens, the features of the root and the accepted tokens with the tokens one further, the bonus twice), the
    same rotary position of the first, the same cache entries attended before them (a step that accepted nothing
    drops the last position read), and block-1 logits equal to 1e-5."""
    for row in decoded:
        theirs, ours = row["theirs"], row["ours"]
        drafts = len(ours["tokens"])  # one per step; the harness drafts after its last step too, and may run a step
        assert drafts == len(ours["accepted"]) and len(theirs["tokens"]) - 2 <= drafts  # more (see below)
        for key in ("tokens", "position", "cached"):
            assert ours[key] == theirs[key][:drafts], key
        torch.testing.assert_close(ours["logits"], theirs["logits"][:drafts], rtol=0.0, atol=1e-5)


def test_reference_feeding_accepts_what_the_harness_accepts_at_every_step(decoded):
    """The accepted counts of every step are the harness's, on all 6 prompts (its loop runs one step more where ours
    has reached `max_new_tokens`), and both outputs are the target's own greedy tokens (the fixture's)."""
    taus = []
    for row in decoded:
        theirs, ours = row["theirs"], row["ours"]
        assert torch.equal(ours["output"], theirs["output"])
        assert ours["accepted"] == theirs["accepted"][: len(ours["accepted"])]
        assert len(theirs["accepted"]) - len(ours["accepted"]) in (0, 1)
        taus.append(ours["tau"])
    assert [len(row["ours"]["accepted"]) for row in decoded] == [22, 21, 23, 18, 18, 24]
    assert round(sum(taus) / len(taus), 3) == 1.939  # the harness's 1.919 counts its extra last step


def test_context_feeding_is_checked(target):
    """An unknown feeding is refused by name, "reference" needs a fixed budget and no online adaptation, a drafter
    without a reference harness refuses it, and "package" stays the default."""
    drafter = SpecBlockDraftModel.from_pretrained(FIXTURES / "decoding_drafter", target=target).eval()
    with pytest.raises(ValueError, match="context_feeding must be one of"):
        TreeGenerationConfig(context_feeding="harness")
    with pytest.raises(ValueError, match="set a fixed tree_budget"):
        TreeGenerationConfig(context_feeding="reference", tree_budget="auto")
    with pytest.raises(ValueError, match="without online adaptation"):
        drafter.set_drafting_settings(context_feeding="reference", tree_budget=8, online_adaptation="always")
    with pytest.raises(ValueError, match="has no reference harness"):
        Eagle3DraftModel.from_target(target, tree_budget=8).set_drafting_settings(context_feeding="reference")
    assert drafter.generation_config.context_feeding == "package"
