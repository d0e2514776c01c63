"""Drafters saved by this package load strictly: a missing, unexpected or misshapen weight is a ValueError naming
the key, through the class's own `from_pretrained` and through `AutoModel`, from one file or from safetensors
shards; `strict=False` is the explicit opt-out (transformers' lenient load, the missing weight initialised afresh).
Before this, such a checkpoint loaded with the weight freshly initialised and only a log line: a drafter that
decodes losslessly and accepts nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from conftest import make_target
from transformers_specblock import DFlashDraftModel, Eagle3DraftModel, LookupTreeModel, SpecBlockDraftModel
from transformers_specblock.hub import SHIPPED_DRAFTERS, shipped_drafter_path

DRAFTERS = {
    "specblock": (SpecBlockDraftModel, dict(tree_budget=8)),
    "eagle3": (Eagle3DraftModel, dict(tree_budget=8)),
    "dflash": (DFlashDraftModel, dict(mask_token_id=127, block_size=4, num_hidden_layers=2, tree_budget=8)),
}
FLAWED_KEY = {"specblock": "layers.0.mlp.down_proj.weight", "eagle3": "layer.mlp.down_proj.weight",
              "dflash": "layers.1.mlp.down_proj.weight"}  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=128)


def save(kind: str, target, folder: Path, sharded: bool) -> Path:
    cls, settings = DRAFTERS[kind]
    torch.manual_seed(0)
    drafter = cls.from_target(target, **settings)
    drafter.save_pretrained(folder, **({"max_shard_size": "40KB"} if sharded else {}))
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    return folder


def shard_files(folder: Path) -> dict[str, Path]:
    """key -> the safetensors file holding it (one file, or the shards an index names)."""
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return {key: folder / "model.safetensors" for key in load_file(folder / "model.safetensors")}
    return {key: folder / name for key, name in json.loads(index.read_text())["weight_map"].items()}


def edit(folder: Path, key: str, change) -> None:
    """Apply `change(tensors, key)` to the file holding `key`, keeping a shard index in step."""
    path = shard_files(folder)[key]
    tensors = load_file(path)
    change(tensors, key)
    save_file(tensors, path, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if k != key or key in tensors}
        data["weight_map"] |= {k: path.name for k in tensors}
        index.write_text(json.dumps(data))


FLAWS = {
    "missing": (lambda tensors, key: tensors.pop(key), "1 missing key"),
    "unexpected": (lambda tensors, key: tensors.update({"bogus.weight": torch.zeros(3)}), "1 unexpected key"),
    "misshapen": (lambda tensors, key: tensors.update({key: tensors[key][:-1].clone()}), "1 misshapen key"),
}


@pytest.mark.parametrize("loader", ["class", "auto"])
@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
@pytest.mark.parametrize("flaw", list(FLAWS))
@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_a_flawed_checkpoint_is_refused_by_name(tmp_path, target, kind, flaw, sharded, loader):
    cls = DRAFTERS[kind][0]
    folder = save(kind, target, tmp_path / kind, sharded)
    load = cls.from_pretrained if loader == "class" else AutoModel.from_pretrained
    assert isinstance(load(folder), cls)  # the intact checkpoint loads
    change, what = FLAWS[flaw]
    edit(folder, FLAWED_KEY[kind], change)
    named = "bogus.weight" if flaw == "unexpected" else FLAWED_KEY[kind]
    with pytest.raises(ValueError, match=f"(?s){what}.*{named}.*strict=False"):
        load(folder)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_strict_false_is_the_explicit_opt_out(tmp_path, target, kind):
    cls = DRAFTERS[kind][0]
    folder = save(kind, target, tmp_path / kind, sharded=False)
    edit(folder, FLAWED_KEY[kind], FLAWS["missing"][0])
    edit(folder, "d2t", FLAWS["unexpected"][0])
    for load in (cls.from_pretrained, AutoModel.from_pretrained):
        model, info = load(folder, strict=False, output_loading_info=True)
        assert isinstance(model, cls)
        assert info["missing_keys"] == {FLAWED_KEY[kind]} and info["unexpected_keys"] == {"bogus.weight"}


def test_misshapen_weight_is_tolerated_only_when_asked(tmp_path, target):
    folder = save("specblock", target, tmp_path / "d", sharded=False)
    edit(folder, "slot_queries.weight", FLAWS["misshapen"][0])
    with pytest.raises(ValueError, match=r"slot_queries.weight \(checkpoint \[3, 64\], model \[4, 64\]\)"):
        SpecBlockDraftModel.from_pretrained(folder)
    model, info = SpecBlockDraftModel.from_pretrained(folder, ignore_mismatched_sizes=True, output_loading_info=True)
    assert [key for key, *_ in info["mismatched_keys"]] == ["slot_queries.weight"]


def test_output_loading_info_still_returns_the_report(tmp_path, target):
    folder = save("eagle3", target, tmp_path / "d", sharded=True)
    model, info = Eagle3DraftModel.from_pretrained(folder, output_loading_info=True)
    assert isinstance(model, Eagle3DraftModel) and not info["missing_keys"] and not info["unexpected_keys"]


def test_lookup_tree_model_loads_strictly(tmp_path, target):
    LookupTreeModel.from_target(target).save_pretrained(tmp_path)
    assert isinstance(AutoModel.from_pretrained(tmp_path), LookupTreeModel)
    edit(tmp_path, "d2t", FLAWS["unexpected"][0])
    with pytest.raises(ValueError, match="bogus.weight"):
        LookupTreeModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", SHIPPED_DRAFTERS)
def test_shipped_drafters_load_strictly(name):
    model, info = AutoModel.from_pretrained(shipped_drafter_path(name), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
