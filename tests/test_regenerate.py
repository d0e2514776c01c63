"""Self-distillation data: the target answers ShareGPT training prompts; an interrupted run resumes."""

from __future__ import annotations

import json

from conftest import make_target
from test_greedy_exactness import letter_tokenizer
from transformers_specblock.hub.assets import load_sharegpt_conversations
from transformers_specblock.commands.regenerate import RegenerateArguments, regenerate


def test_regenerate_writes_answers_and_resumes(tmp_path):
    model_dir = tmp_path / "tiny"
    target = make_target("llama", vocab_size=24, seed=0, eos_token_id=1)
    tokenizer = letter_tokenizer(24)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}b{% endfor %}{% if add_generation_prompt %}c{% endif %}"
    tokenizer.eos_token = "b"
    target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    output = tmp_path / "regen.jsonl"
    args = RegenerateArguments(
        target_model=str(model_dir), output=str(output), num_conversations=2, max_new_tokens=4, batch_size=2,
        max_prompt_tokens=400,
    )  # fmt: skip
    regenerate(args)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    train_ids = {r["id"] for r in load_sharegpt_conversations("train")}
    assert len(lines) == 2 and all(line["id"] in train_ids for line in lines)  # never the held-out split
    for line in lines:
        assert [t["from"] for t in line["conversations"]] == ["human", "gpt"]
    regenerate(RegenerateArguments(**{**args.__dict__, "num_conversations": 3}))
    again = [json.loads(line) for line in output.read_text().splitlines()]
    assert again[:2] == lines and len(again) == 3  # the two finished answers were kept, one more was added
