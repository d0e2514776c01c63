"""Shared fixtures: tiny random Llama / Qwen2 targets and drafters sized for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import transformers_specblock  # noqa: F401  (registers Auto classes and the generate routing)
from transformers_specblock import SpecBlockDraftModel
from transformers_specblock.generation import auto_choosers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    # a wide init spreads the logits, so greedy choices are not decided by float round-off
    initializer_range=0.2,
    bos_token_id=0,
    eos_token_id=None,
    pad_token_id=None,
)


def load_example(name: str) -> ModuleType:
    """The script examples/<name>.py as a module (examples are not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_target(family: str = "llama", vocab_size: int = 128, seed: int = 0, attn: str = "sdpa", **overrides):
    """A tiny random causal LM of the given family, in eval mode."""
    torch.manual_seed(seed)
    settings = {**TINY, "vocab_size": vocab_size, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**settings))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**settings, use_sliding_window=False))
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn
    return model.eval()


def make_drafter(target, seed: int = 0, **overrides) -> SpecBlockDraftModel:
    """A random SpecBlock drafter for `target`; a fixed tree budget unless a test asks for "auto" (which could
    decline to speculate on a tiny model and leave the tree code untested)."""
    overrides.setdefault("tree_budget", 32)
    torch.manual_seed(seed + 1000)
    return SpecBlockDraftModel.from_target(target, **overrides)


@pytest.fixture(autouse=True)
def own_auto_budget_cache(tmp_path_factory, monkeypatch):
    """Each test's "auto" choosers time the target and learn afresh (tests of the on-disk cache use their own
    folders): what an earlier test or run left in the user's cache folder must not decide a test."""
    folder = tmp_path_factory.mktemp("auto-budget-cache")
    monkeypatch.setattr(auto_choosers, "default_cache_dir", lambda: folder)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on 2 shared cores: one intra-op thread is far faster than two contending ones."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def tiny_llama():
    return make_target("llama")


@pytest.fixture
def tiny_qwen2():
    return make_target("qwen2")
