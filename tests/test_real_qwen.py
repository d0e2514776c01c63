"""The drafters shipped for the packaged Qwen2.5-Coder targets on the real target: one HumanEval prompt each, float32,
output identical to plain greedy, more than one token committed per verification."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from transformers_specblock import load_packaged_model, load_prompts
from transformers_specblock.hub import SHIPPED_DRAFTERS, shipped_drafter_path

pytestmark = pytest.mark.slow  # loads (and on a fresh machine converts) the packaged Qwen2.5-Coder GGUF

QWEN_TARGETS = ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct")
SHIPPED_FOR_QWEN = [(name, target) for name in SHIPPED_DRAFTERS for target in QWEN_TARGETS if name.endswith(target)]
ALONE = dict(tree_budget=8, prompt_lookup_num_tokens=0, ngram_cache_num_tokens=0, suffix_cache_num_tokens=0)


@pytest.fixture(scope="module")
def targets():
    loaded = {}

    def load(name: str):
        if name not in loaded:
            try:
                loaded[name] = load_packaged_model(name, dtype="float32")
            except ImportError as err:  # `make test` installs the 0.5B GGUF packages (`make qwen-models` both)
                pytest.fail(f"{err} (make qwen-models)")
        return loaded[name]

    return load


def test_a_drafter_is_shipped_for_a_qwen_target():
    assert SHIPPED_FOR_QWEN, SHIPPED_DRAFTERS


@pytest.mark.parametrize("name,target_name", SHIPPED_FOR_QWEN)
def test_shipped_qwen_drafter_is_exact_and_accepts(name, target_name, targets, one_thread):
    target, tokenizer = targets(target_name)
    drafter = AutoModel.from_pretrained(shipped_drafter_path(name), dtype=torch.float32).eval()
    prompt = load_prompts("humaneval", num_prompts=1, tokenizer=tokenizer)[0]["text"]
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    reference = target.generate(**inputs, do_sample=False, max_new_tokens=32)
    with drafter.tree_settings(**ALONE):  # the weights' own trees: no free candidates, a fixed budget
        out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=32)
    assert torch.equal(out, reference), name
    assert drafter.last_stats.tau > 1.2, (name, drafter.last_stats.accepted_per_iteration)
