"""A DFlash drafter saved in 16 bits serves a target of another dtype on BOTH paths: this package's tree loop casts
it on binding, and transformers' own `speculation_type="dflash"` chain (which calls the drafter's forward with the
target's embeddings and feeds its output to the target's `lm_head`) used to crash deep in a matmul ("expected m1 and
m2 to have the same dtype"); the drafter now follows the target there too. The docs' snippet runs as written."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from conftest import make_target
from test_dflash import PROMPTS, make_dflash
from transformers_specblock import DFlashDraftModel

SNIPPET_PAGE = Path(__file__).parents[1] / "docs" / "how-to" / "published-drafters.md"


@pytest.mark.parametrize("saved, target_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                                  (torch.bfloat16, torch.float16)])  # fmt: skip
@pytest.mark.parametrize("speculation_type", ["dflash", None])
def test_drafter_saved_in_16_bits_follows_the_target(tmp_path, one_thread, saved, target_dtype, speculation_type):
    target = make_target("llama", vocab_size=128).to(target_dtype)
    make_dflash(make_target("llama", vocab_size=128)).to(saved).save_pretrained(tmp_path)
    drafter = AutoModel.from_pretrained(tmp_path)  # dtype "auto": as saved
    assert isinstance(drafter, DFlashDraftModel) and drafter.dtype == saved
    for prompt in PROMPTS:
        plain = target.generate(prompt, do_sample=False, max_new_tokens=24)
        out = target.generate(prompt, do_sample=False, max_new_tokens=24, assistant_model=drafter,
                              speculation_type=speculation_type)  # fmt: skip
        if target_dtype == torch.float32:  # float32: token for token (16-bit targets may flip near-ties)
            assert out.tolist() == plain.tolist()
        assert out.shape[1] == plain.shape[1]
    assert drafter.dtype == saved  # both paths leave the drafter as loaded


def docs_dflash_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", SNIPPET_PAGE.read_text(), flags=re.S)
    (snippet,) = [b for b in blocks if 'speculation_type="dflash"' in b and "shipped_drafter_path" in b]
    return textwrap.dedent(snippet)


def test_docs_snippet_is_found():
    snippet = docs_dflash_snippet()
    assert "AutoModel.from_pretrained(path)" in snippet and "float32" in snippet


@pytest.mark.slow  # the packaged SmolLM2-135M-Instruct in float32 and the shipped bfloat16 DFlash drafter
def test_docs_snippet_runs_as_written(one_thread):
    scope: dict = {}
    exec(compile(docs_dflash_snippet(), str(SNIPPET_PAGE), "exec"), scope)
    target, tok, inputs = scope["target"], scope["tok"], scope["inputs"]
    assert target.dtype == torch.float32
    plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert scope["chain"].tolist() == plain.tolist() and scope["tree"].tolist() == plain.tolist()
    assert scope["dflash"].dtype == torch.bfloat16  # as loaded: serving casts nothing for good
