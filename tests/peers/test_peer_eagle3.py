"""EAGLE-3 checkpoints checked against the peers' OWN code (issue 29): vLLM's `speculators` 0.9.0 and SGLang's
`specforge` 0.2.0, each run in its own venv (`peer_envs.py`) on the same inputs as ours.

Every comparison covers three training-time-test steps, so it also checks what feeds the next step (the pre-norm
output), the rotary positions of later steps (+1 per step) and the attention rule (the step-0 context, then the
chain's own earlier steps). Tolerance, float32: |ours - theirs| <= 2e-5 + 1e-5 |theirs| (observed ~6e-6).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from conftest import make_target
from test_checkpoint_formats import randomize, write_published
from transformers_specblock import Eagle3DraftModel
from transformers_specblock.hub import load_packaged_model
from transformers_specblock.hub.assets import resolve_model_path

pytestmark = [pytest.mark.peers, pytest.mark.usefixtures("one_thread")]
TTT_STEPS, LENGTH = 3, 10
TOLERANCE = dict(rtol=1e-5, atol=2e-5)
LAYER_IDS = [1, 3, 6]  # not speculators' default [2, L//2, L-3] = [2, 4, 5] for this 8-layer target


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A tiny random Llama target saved to a folder (the verifier the peers read their embedding / lm_head from)."""
    folder = tmp_path_factory.mktemp("target")
    make_target("llama", num_hidden_layers=8).save_pretrained(folder)
    return folder, LlamaForCausalLM.from_pretrained(folder).eval()


def drafter_for(target, **overrides) -> Eagle3DraftModel:
    torch.manual_seed(11)
    overrides = {"tree_budget": 8, "draft_vocab_size": 96, "target_layer_ids": LAYER_IDS, **overrides}
    return randomize(Eagle3DraftModel.from_target(target, **overrides))


def shared_inputs(folder, drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """Random target features and tokens; the peers get them in their sequence convention (features of position t
    paired with token t + 1), saved to `folder / inputs.safetensors`."""
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(1, LENGTH, 3 * drafter.config.target_hidden_size, generator=generator)
    tokens = torch.randint(0, drafter.config.vocab_size, (1, LENGTH), generator=generator)
    save_file({"features": features[:, :-1].contiguous(), "input_ids": tokens[:, 1:].contiguous()},
              folder / "inputs.safetensors")  # fmt: skip
    return features, tokens


def our_logits(drafter, features, tokens) -> torch.Tensor:
    """Our training-time-test logits [steps, 1, LENGTH - 1, Vd]; step 0 must also be what decoding computes
    (`draft_step`, the tree loop's forward, over the committed positions)."""
    with torch.no_grad():
        out = drafter(tokens, features, ttt_steps=TTT_STEPS, return_all_steps=True)
        positions = torch.arange(1, LENGTH)[None]
        causal = torch.ones(LENGTH - 1, LENGTH - 1, dtype=torch.bool).tril()[None]
        decoding = drafter.draft_step(drafter.fuse_features(features[:, :-1]), tokens[:, 1:], positions, causal)
    torch.testing.assert_close(decoding.logits, out.all_logits[0], rtol=1e-5, atol=1e-5)
    return torch.stack(out.all_logits)


def assert_same_steps(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Step s is compared on the slots whose chain stays inside the sequence (the tails differ by padding only)."""
    assert ours.shape == theirs.shape
    for step in range(TTT_STEPS):
        valid = LENGTH - 1 - step
        torch.testing.assert_close(ours[step, :, :valid], theirs[step, :, :valid], **TOLERANCE)
        assert torch.equal(ours[step, :, :valid].argmax(-1), theirs[step, :, :valid].argmax(-1))


@pytest.mark.parametrize("checkpoint_format", ["eagle3", "speculators"])
def test_speculators_reads_our_export_and_computes_our_logits(checkpoint_format, saved_target, tmp_path, run_peer):
    """Our export read by speculators as its users read it (`convert_model(..., algorithm="eagle3")` for the
    SpecForge layout; directly for the speculators layout), then its `Eagle3DraftModel` forward."""
    folder, target = saved_target
    drafter = drafter_for(target)
    drafter.save_pretrained(tmp_path / "export", checkpoint_format=checkpoint_format)
    features, tokens = shared_inputs(tmp_path, drafter)
    facts = run_peer(
        "speculators", "speculators_eagle3", checkpoint=tmp_path / "export", verifier=folder,
        converted=tmp_path / "converted", inputs=tmp_path / "inputs.safetensors",
        output=tmp_path / "theirs.safetensors", ttt_steps=TTT_STEPS,
    )  # fmt: skip
    assert not facts["embedding_all_zero"]
    assert_same_steps(our_logits(drafter, features, tokens), load_file(tmp_path / "theirs.safetensors")["logits"])
    if checkpoint_format == "speculators":  # the format vLLM reads: our layer ids are the ones it captures
        assert facts["layer_ids_used"] == LAYER_IDS
    else:  # its converter reads no layer-id field (only its algorithm kwargs): its default wins
        assert facts["layer_ids_in_config"] is None and facts["layer_ids_used"] == [2, 4, 5]


def test_specforge_model_class_loads_our_export_strictly_and_computes_our_logits(saved_target, tmp_path, run_peer):
    folder, target = saved_target
    drafter = drafter_for(target)
    drafter.save_pretrained(tmp_path / "export", checkpoint_format="eagle3")
    features, tokens = shared_inputs(tmp_path, drafter)
    facts = run_peer(
        "specforge", "specforge_eagle3", checkpoint=tmp_path / "export", inputs=tmp_path / "inputs.safetensors",
        output=tmp_path / "theirs.safetensors", ttt_steps=TTT_STEPS,
    )  # fmt: skip
    assert facts["class"] == "LlamaForCausalLMEagle3"
    assert facts["missing_keys"] == [] and facts["unexpected_keys"] == []  # strict, in SpecForge's own model
    assert facts["from_pretrained_missing_keys"] == facts["from_pretrained_unexpected_keys"] == []
    assert facts["from_pretrained_mismatched_keys"] == []
    # its from_pretrained (transformers 5.8.1) leaves the rotary caches uninitialised: why the trainer's path is used
    assert facts["from_pretrained_rotary_finite"] is False
    assert facts["norm_output"] is True and facts["head_dim"] == drafter.config.head_dim
    assert_same_steps(our_logits(drafter, features, tokens), load_file(tmp_path / "theirs.safetensors")["logits"])


def test_safeailab_checkpoint_converted_by_speculators_loads_strictly_and_decodes_the_same(
    saved_target, tmp_path, run_peer
):
    """A SafeAILab-layout checkpoint (pytorch_model.bin, midlayer.*, no embedding) and what `speculators convert`
    makes of it load here to the same weights and decode identically (and as plain greedy)."""
    folder, target = saved_target
    native = drafter_for(target, target_layer_ids=[2, 4, 5])  # SafeAILab names no ids: the default
    write_published(tmp_path / "eagle", native, "eagle")
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    config.pop("head_dim")  # as EAGLE's own configs (write_published adds one that EAGLE ignores: speculators reads it)
    (tmp_path / "eagle" / "config.json").write_text(json.dumps(config))
    run_peer("speculators", "speculators_eagle3", checkpoint=tmp_path / "eagle", verifier=folder,
             converted=tmp_path / "converted", convert_only=True)  # fmt: skip
    assert json.loads((tmp_path / "converted" / "config.json").read_text())["speculators_model_type"] == "eagle3"
    direct = Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target)
    converted = Eagle3DraftModel.from_pretrained(tmp_path / "converted", target=target)
    assert converted.config.target_layer_ids == direct.config.target_layer_ids == [2, 4, 5]
    theirs = converted.state_dict()
    for key, tensor in direct.state_dict().items():
        assert torch.equal(tensor, theirs[key]), key
    prompt = torch.tensor([[0, 5, 9, 17, 33, 2, 5, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
    for drafter in (direct, converted):
        with drafter.tree_settings(tree_budget=8):
            assert torch.equal(target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=24),
                               plain)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_format", ["eagle3", "speculators"])
def test_the_shipped_drafter_trained_here_computes_the_same_in_the_peers(checkpoint_format, tmp_path, run_peer):
    """The shipped EAGLE-3 drafter (trained here for SmolLM2-135M-Instruct), exported, on the real target's features
    of a real prompt: speculators' and SpecForge's forwards give its logits over three steps."""
    target, tokenizer = load_packaged_model("smollm2-135m-instruct")
    drafter = Eagle3DraftModel.from_pretrained("eagle3-smollm2-135m-instruct", target=target)
    drafter.save_pretrained(tmp_path / "export", checkpoint_format=checkpoint_format)
    text = "The three primary colours are red, yellow and blue; mixing them gives"
    tokens = tokenizer(text, return_tensors="pt").input_ids[:, :LENGTH]
    assert tokens.shape[1] == LENGTH
    with torch.no_grad():
        hidden_states = target(tokens, output_hidden_states=True).hidden_states
    features = torch.cat([hidden_states[i] for i in drafter.config.target_layer_ids], dim=-1)
    save_file({"features": features[:, :-1].contiguous(), "input_ids": tokens[:, 1:].contiguous()},
              tmp_path / "inputs.safetensors")  # fmt: skip
    ours = our_logits(drafter, features, tokens)
    files = dict(inputs=tmp_path / "inputs.safetensors", output=tmp_path / "theirs.safetensors", ttt_steps=TTT_STEPS)
    facts = run_peer("speculators", "speculators_eagle3", checkpoint=tmp_path / "export",
                     verifier=resolve_model_path("smollm2-135m-instruct"), converted=tmp_path / "converted", **files)
    if checkpoint_format == "speculators":
        assert facts["layer_ids_used"] == drafter.config.target_layer_ids
    assert_same_steps(ours, load_file(tmp_path / "theirs.safetensors")["logits"])
    if checkpoint_format == "eagle3":
        facts = run_peer("specforge", "specforge_eagle3", checkpoint=tmp_path / "export", **files)
        assert facts["missing_keys"] == [] and facts["unexpected_keys"] == []
        assert_same_steps(ours, load_file(tmp_path / "theirs.safetensors")["logits"])
