"""Hub model cards for trained drafters, generated from what the config records (never written by hand).

`TreeDraftModel.save_pretrained` writes `README.md` next to the weights, so `push_to_hub` sends it along. The card
reads `config.target_name_or_path`, `config.training_info` (command, data, compute, time) and
`config.eval_results` (measured tau / speed-up per prompt set), each filled in by the training and evaluation code.
"""

from __future__ import annotations

import json
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

USAGE = """```python
import transformers_specblock
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers_specblock import {cls}

target = AutoModelForCausalLM.from_pretrained("{target}")
tokenizer = AutoTokenizer.from_pretrained("{target}")
drafter = {cls}.from_pretrained("{repo}")
inputs = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128, do_sample=False)
print(tokenizer.decode(out[0]), drafter.last_stats.tau)
```"""


EVAL_COLUMNS = ("dataset", "prompts", "max_new_tokens", "tau", "speedup_vs_plain", "tokens_per_s", "drafting_share",
                "identical_to_plain_greedy", "hardware")  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    """Evaluation rows as a Markdown table: the usual columns first, in a fixed order, then any others."""
    if not rows:
        return "_No evaluation recorded yet._"
    seen = dict.fromkeys(key for row in rows for key in row)
    keys = [k for k in EVAL_COLUMNS if k in seen] + [k for k in seen if k not in EVAL_COLUMNS]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [row.get(k, "") for k in keys]
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines)


def build_model_card(drafter: Any, repo_id: str | None = None) -> ModelCard:
    """A Hub model card (YAML metadata + description) for `drafter`, from its config's records."""
    config = drafter.config
    cls = type(drafter).__name__
    target = getattr(config, "target_name_or_path", None) or "unknown-target"
    training: dict[str, Any] = getattr(config, "training_info", None) or {}
    evaluation: list[dict[str, Any]] = getattr(config, "eval_results", None) or []
    card_data = ModelCardData(
        base_model=target if target != "unknown-target" else None,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", config.model_type, "draft-model", "transformers-specblock"],
        datasets=training.get("datasets"),
        license=training.get("license"),
    )
    num_params = sum(p.numel() for p in drafter.parameters())
    content = f"""---
{card_data.to_yaml()}
---

# {repo_id or cls + " for " + target}

A speculative-decoding drafter (`{cls}`, model type {config.model_type}) for **{target}**, made with
`transformers-specblock`. It reads three hidden states of the frozen target (layers {config.target_layer_ids})
and its input embedding (not stored here), and drafts token trees that the target verifies in one forward:
output stays exactly the target's own (greedy) or its distribution (sampling).

- Parameters (without the target embedding): {num_params / 1e6:.1f} M; draft vocabulary
  {getattr(config, "draft_vocab_size", config.vocab_size)} of {config.vocab_size} target tokens.
- Tree defaults: {json.dumps({k: getattr(config, k) for k in ("block_size", "max_blocks", "tree_top_k", "tree_depth", "tree_budget", "ttt_steps") if hasattr(config, k)})}

## Usage

{USAGE.format(cls=cls, target=target, repo=repo_id or "path/to/this/folder")}

## Training

{_training_section(training)}

## Evaluation (greedy decoding, batch 1)

{_table(evaluation)}
"""
    return ModelCard(content)


def _training_section(training: dict[str, Any]) -> str:
    if not training:
        return "_Not trained (freshly initialised weights)._"
    lines = []
    for key, value in training.items():
        if key == "command":
            lines.append(f"- command:\n\n  ```bash\n  {value}\n  ```")
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)
