"""The `generate` router patches transformers only where its private methods have the signatures it was written for;
elsewhere `generate(assistant_model=drafter)` says which releases are supported and what to call instead."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from transformers.generation import GenerationMixin

import transformers_specblock
from conftest import make_drafter, make_target
from transformers_specblock.generation import integration
from transformers_specblock.utils import SUPPORTED_TRANSFORMERS

SUPPORTED_RELEASES = ("5.23.0", "5.24.0", "5.25.0")

PROMPT = torch.tensor([[0, 5, 9, 3, 7, 2]])


def test_this_transformers_has_the_routed_signatures():
    problems = integration.router_problems()
    if not problems[:1] or not problems[0].startswith("its version"):  # a supported release: routed
        assert problems == [] and GenerationMixin._assisted_decoding is integration._assisted_decoding
    else:  # a newer release (the compatibility run of `.ci/run`): refused, nothing patched, the fix named
        assert GenerationMixin._assisted_decoding is integration._STOCK_ASSISTED_DECODING
        target = make_target(vocab_size=32, seed=1)
        with pytest.raises(AttributeError, match=rf"on transformers {SUPPORTED_TRANSFORMERS} .*specblock.generate"):
            target.generate(PROMPT, max_new_tokens=6, assistant_model=make_drafter(target, tree_budget=4))


def test_a_release_outside_the_supported_ones_is_not_patched_even_with_the_same_signatures():
    """A release can keep the three signatures and change what they are given (5.24 renamed the cache argument):
    the version decides too, and the table of releases and the declared range agree."""
    assert integration.router_problems(version="5.26.0") == [f"its version 5.26.0 is outside {SUPPORTED_TRANSFORMERS}"]
    assert integration.router_problems(version="5.22.2")[0].startswith("its version 5.22.2")
    for release in SUPPORTED_RELEASES:
        assert not integration.router_problems(version=release)[:1] or "outside" not in integration.router_problems(
            version=release
        )[0]
    assert integration.router_problems(version="5.23.0") == integration.router_problems(version="5.23.1.dev0")
    supported = SpecifierSet(SUPPORTED_TRANSFORMERS)
    assert {f"{major}.{minor}" for major in (5,) for minor in range(20, 30) if f"{major}.{minor}.0" in supported} == set(
        integration.ROUTED_SIGNATURES
    )


def test_the_declared_transformers_range_is_the_supported_one():
    """pyproject.toml allows exactly the releases the router supports (and CI proves)."""
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    declared = next(d for d in project["dependencies"] if d.startswith("transformers"))
    assert Requirement(declared).specifier == SpecifierSet(SUPPORTED_TRANSFORMERS)


def test_other_internals_are_not_patched_and_generate_names_the_fix(monkeypatch, one_thread):
    target = make_target(vocab_size=32, seed=1)
    drafter = make_drafter(target, tree_budget=4)
    expected = target.generate(PROMPT, max_new_tokens=6, do_sample=False)

    def changed(self, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        raise AssertionError("never called")

    transformers_specblock.uninstall()
    monkeypatch.setattr(integration, "_STOCK_ASSISTED_DECODING", changed)  # a release whose method differs
    try:
        with pytest.warns(UserWarning, match=r"_assisted_decoding.*differs.*patch-free route"):
            assert transformers_specblock.install() is False
        assert GenerationMixin._assisted_decoding is not integration._assisted_decoding  # nothing patched
        with pytest.raises(AttributeError, match=rf"on transformers {SUPPORTED_TRANSFORMERS} .*specblock.generate"):
            target.generate(PROMPT, max_new_tokens=6, do_sample=False, assistant_model=drafter)
        out = transformers_specblock.generate(target, PROMPT, max_new_tokens=6, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, expected)  # the patch-free route works unpatched
    finally:
        monkeypatch.undo()
        assert transformers_specblock.install() is True
    assert torch.equal(target.generate(PROMPT, max_new_tokens=6, do_sample=False, assistant_model=drafter), expected)
