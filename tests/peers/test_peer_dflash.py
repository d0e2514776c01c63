"""DFlash checked against z-lab's own code (`dflash` 0.1.0 in its venv, issue 29): a drafter built and saved by
their `DFlashDraftModel` (random, Qwen3-shaped, their `target_layer_ids` default) for a small random Qwen3 target
loads strictly here, computes their block (hidden states and logits over the target's head; float32, |ours - theirs|
<= 2e-5 + 1e-5 |theirs|) and decodes in our tree loop exactly as plain greedy, as does their `dflash_generate`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from transformers_specblock import DFlashDraftModel

pytestmark = [pytest.mark.peers, pytest.mark.usefixtures("one_thread")]
TOLERANCE = dict(rtol=1e-5, atol=2e-5)
PROMPT = [3, 17, 92, 5, 44, 8, 101, 64, 23]
BLOCK, MASK, NEW_TOKENS = 4, 127, 24


@pytest.fixture(scope="module")
def saved_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    Qwen3ForCausalLM(config).eval().save_pretrained(folder)
    return folder, Qwen3ForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("draft_layers", [1, 2])
def test_their_drafter_loads_strictly_computes_their_block_and_decodes_like_greedy(
    draft_layers, saved_qwen3, tmp_path, run_peer
):
    folder, target = saved_qwen3
    facts = run_peer(
        "dflash", "dflash_drafter", target=folder, output_dir=tmp_path / "drafter", tensors=tmp_path / "t.safetensors",
        seed=draft_layers, draft_layers=draft_layers, block_size=BLOCK, mask_token_id=MASK, prompt=PROMPT,
        max_new_tokens=NEW_TOKENS,
    )  # fmt: skip
    theirs = load_file(tmp_path / "t.safetensors")
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "drafter", target=target, tree_budget=8)
    assert drafter.config.target_layer_ids == facts["target_layer_ids"]  # their default: [3] for 1 layer, [1, 3]
    assert drafter.config.block_size == BLOCK and drafter.config.mask_token_id == MASK
    written = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"]

    with torch.no_grad():  # features captured here, from the same target (their +1 offset = our feature_layers)
        out = target(torch.tensor([PROMPT]), output_hidden_states=True)
        context = torch.cat([out.hidden_states[i] for i in drafter.config.feature_layers], dim=-1)
        torch.testing.assert_close(context, theirs["context"], rtol=0, atol=0)
        noise = drafter.embed_block(torch.tensor([PROMPT[-1]]))
        hidden = drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state
        logits = drafter.draft_logits(hidden)
    torch.testing.assert_close(hidden, theirs["hidden"], **TOLERANCE)
    torch.testing.assert_close(logits, theirs["logits"], **TOLERANCE)
    assert torch.equal(logits.argmax(-1), theirs["logits"].argmax(-1))

    prompt = torch.tensor([PROMPT])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(theirs["generated"], plain)  # their chain loop is lossless on this target too
    tree = target.generate(prompt, assistant_model=drafter, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert torch.equal(tree, plain)


def test_speculators_converts_our_dflash_export_and_computes_our_block(saved_qwen3, tmp_path, run_peer):
    """Our `checkpoint_format="dflash"` export through speculators' DFlash converter (vLLM serves DFlash from its
    format): the same captured layers (HF `hidden_states` indices) and the same block."""
    folder, target = saved_qwen3
    torch.manual_seed(4)
    drafter = DFlashDraftModel.from_target(
        target, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        block_size=BLOCK, mask_token_id=MASK, tree_budget=8,
    )  # fmt: skip
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            param.copy_(torch.rand(param.shape) + 0.5 if "norm" in name else torch.randn(param.shape) * 0.15)
    drafter.save_pretrained(tmp_path / "export", checkpoint_format="dflash")
    anchor = len(PROMPT) - 1  # the block of the last prompt token: context = the features before it
    tokens = torch.tensor([PROMPT + [0] * BLOCK])  # speculators anchors only where a whole block follows
    with torch.no_grad():
        out = target(tokens, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in drafter.config.feature_layers], dim=-1)
        hidden = drafter(noise_embeds=drafter.embed_block(tokens[:, anchor]),
                         context_hidden_states=features[:, :anchor]).last_hidden_state  # fmt: skip
        logits = drafter.draft_logits(hidden)
    save_file({"features": features.contiguous(), "input_ids": tokens}, tmp_path / "inputs.safetensors")
    facts = run_peer(
        "speculators", "speculators_dflash", checkpoint=tmp_path / "export", verifier=folder,
        converted=tmp_path / "converted", inputs=tmp_path / "inputs.safetensors",
        output=tmp_path / "theirs.safetensors", anchor=anchor,
    )  # fmt: skip
    assert facts["aux_hidden_state_layer_ids"] == drafter.config.feature_layers
    assert (facts["block_size"], facts["mask_token_id"]) == (BLOCK, MASK)
    theirs = load_file(tmp_path / "theirs.safetensors")
    torch.testing.assert_close(hidden, theirs["hidden"], **TOLERANCE)
    torch.testing.assert_close(logits, theirs["logits"], **TOLERANCE)
