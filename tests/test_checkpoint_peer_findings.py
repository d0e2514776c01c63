"""Regression tests for what running the peers' own code found (issue 29; the peers' tests are tests/peers/):

* the EAGLE-3 export shipped no `embed_tokens.weight`, and speculators 0.9.0 then ran on an all-zero embedding;
* speculators' converter reads none of the layer-id fields of the SpecForge layout: the speculators format
  (`checkpoint_format="speculators"`) carries them where speculators and vLLM read them;
* our reader of a speculators config dropped its top-level `norm_output` / `fc_norm` / `norm_before_fc`.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_target
from test_checkpoint_formats import assert_same_weights, native_drafter, write_published
from transformers_specblock import Eagle3DraftModel


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.mark.parametrize("checkpoint_format", ["eagle3", "speculators"])
def test_export_holds_the_target_embedding(checkpoint_format, target, tmp_path):
    drafter = native_drafter("eagle", target)
    drafter.save_pretrained(tmp_path, checkpoint_format=checkpoint_format)
    state = load_file(tmp_path / "model.safetensors")
    assert torch.equal(state["embed_tokens.weight"], target.get_input_embeddings().weight)
    again = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key


def test_export_of_an_unbound_drafter_is_refused(target, tmp_path):
    unbound = Eagle3DraftModel(native_drafter("eagle", target).config)
    with pytest.raises(ValueError, match=r"must hold the token embedding.*bind_target"):
        unbound.save_pretrained(tmp_path / "out", checkpoint_format="eagle3")
    assert not (tmp_path / "out").exists()


def test_speculators_format_carries_our_layer_ids_and_round_trips(target, tmp_path):
    drafter = native_drafter("eagle", target, target_layer_ids=[1, 3, 4], fc_norm=True, norm_before_residual=True)
    drafter.save_pretrained(tmp_path, checkpoint_format="speculators")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert (config["fc_norm"], config["norm_before_residual"], config["norm_output"]) == (True, True, False)
    assert config["speculators_config"]["verifier"]["name_or_path"] is None  # an in-memory target: no name to load
    assert all(key.startswith(("layers.0.", "fc", "norm", "lm_head", "embed", "d2t", "t2d"))
               for key in load_file(tmp_path / "model.safetensors"))  # fmt: skip
    again = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert again.config.target_layer_ids == [1, 3, 4] and again.config.fc_norm and again.config.norm_before_residual
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[key]), key


def rewrite_config(folder, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))


def test_speculators_fc_norm_is_read(target, tmp_path):
    native = native_drafter("speculators", target, fc_norm=True)
    write_published(tmp_path, native, "speculators")  # fc_norm.{0,1,2}.weight in the file
    rewrite_config(tmp_path, fc_norm=True)
    assert_same_weights(native, Eagle3DraftModel.from_pretrained(tmp_path, target=target))


@pytest.mark.parametrize(
    ("field", "message"),
    [("norm_output", "norm_output=true .*feeds the normed output"), ("norm_before_fc", "norm_before_fc=true")],
)
def test_speculators_norms_we_do_not_compute_are_refused(field, message, target, tmp_path):
    write_published(tmp_path, native_drafter("speculators", target), "speculators")
    Eagle3DraftModel.from_pretrained(tmp_path, target=target)  # loads as written
    rewrite_config(tmp_path, **{field: True})
    with pytest.raises(ValueError, match=message):
        Eagle3DraftModel.from_pretrained(tmp_path, target=target)
