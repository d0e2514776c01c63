"""Hub model cards for trained drafters, generated from what the config records (never written by hand).

`TreeDraftModel.save_pretrained` writes `README.md` next to the weights, so `push_to_hub` sends it along; the
``python -m transformers_specblock.commands.card FOLDER`` command rewrites it from a saved ``config.json``. The card
reads `config.base_model_id` (the target's Hub id, recorded by `from_target` and by training), `config.training_info`
(command and sessions, detected hardware, data source, license, tokens, time: written by `training.run`) and
`config.eval_results` (measured tau / speed-up and detected hardware per prompt set: written by the evaluation
script), each filled in by the code at the time it happened.
"""

from __future__ import annotations

import json
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

USAGE = """```python
import torch
import transformers_specblock  # routes generate(assistant_model=<drafter>) into the tree decoding loop
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers_specblock import {cls}

target_id = "{target}"
dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
target = AutoModelForCausalLM.from_pretrained(target_id, dtype=dtype, device_map="auto")
tokenizer = AutoTokenizer.from_pretrained(target_id)
drafter = {cls}.from_pretrained("{repo}")  # generate() binds it and moves it to the target
inputs = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello!"}}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True).to(target.device)
out = target.generate(**inputs, assistant_model=drafter, max_new_tokens=128, do_sample=False)
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True), drafter.last_stats.tau)
```"""


EVAL_COLUMNS = ("dataset", "prompts", "max_new_tokens", "tau", "speedup_vs_plain", "tokens_per_s", "drafting_share",
                "identical_to_plain_greedy", "hardware")  # fmt: skip


def _table(rows: list[dict[str, Any]]) -> str:
    """Evaluation rows as a Markdown table: the usual columns first, in a fixed order, then any others (sorted: a
    saved config sorts its keys, so the card must not depend on their order)."""
    if not rows:
        return "_No evaluation recorded yet._"
    seen = dict.fromkeys(key for row in rows for key in row)
    keys = [k for k in EVAL_COLUMNS if k in seen] + sorted(k for k in seen if k not in EVAL_COLUMNS)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [row.get(k, "") for k in keys]
        lines.append("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells) + " |")
    return "\n".join(lines)


def build_model_card(drafter: Any, repo_id: str | None = None) -> ModelCard:
    """A Hub model card (YAML metadata + description) for `drafter`, from its config's records and the decoding
    settings of its `generation_config` that differ from the package's defaults."""
    num_params = sum(p.numel() for p in drafter.parameters())
    decoding = drafter.generation_config.changed_settings()
    return model_card_from_config(drafter.config, type(drafter).__name__, num_params, repo_id, decoding)


def model_card_from_config(
    config: Any, cls: str, num_params: int, repo_id: str | None = None, decoding: dict[str, Any] | None = None
) -> ModelCard:
    """The card of a drafter of class `cls` with `num_params` parameters, from its config's records and `decoding`,
    the settings of its `generation_config` that differ from the package's defaults.

    ``base_model`` is the recorded Hub id of the target (``config.base_model_id``), never a path: without one the
    card names no base model. ``license`` is the one given at training (``training_info["license"]``), else none.
    """
    base_model = getattr(config, "base_model_id", None)
    training: dict[str, Any] = getattr(config, "training_info", None) or {}
    evaluation: list[dict[str, Any]] = getattr(config, "eval_results", None) or []
    text_type = getattr(config, "target_model_type", None) or "causal LM"
    shape = f"{config.target_num_hidden_layers} layers, vocabulary {config.vocab_size}"
    target = base_model or f"a {text_type} target ({shape}; no Hub id recorded)"
    card_data = ModelCardData(
        base_model=base_model,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["speculative-decoding", config.model_type, "draft-model", "transformers-specblock"],
        datasets=training.get("datasets"),
        license=training.get("license"),
    )
    blocks = {k: getattr(config, k) for k in BLOCK_SETTINGS if hasattr(config, k)}
    reads = (  # a DFlash drafter names decoder layers whose outputs it reads, and uses the target's lm_head
        f"the outputs of target layers {config.target_layer_ids}, its input embedding and its `lm_head`"
        if config.model_type == "dflash_drafter"
        else f"three hidden states of the frozen target (layers {config.target_layer_ids})\nand its input embedding"
    )
    content = f"""---
{card_data.to_yaml()}
---

# {repo_id or cls + " for " + target}

A speculative-decoding drafter (`{cls}`, model type {config.model_type}) for **{target}**, made with
`transformers-specblock`. It reads {reads} (not stored here), and drafts token trees that the target verifies in one forward:
output stays exactly the target's own (greedy) or its distribution (sampling).

- Parameters (without the target embedding): {num_params / 1e6:.1f} M; draft vocabulary
  {getattr(config, "draft_vocab_size", config.vocab_size)} of {config.vocab_size} target tokens.
- Block settings (`config.json`): {json.dumps(blocks) if blocks else "none (no drafter network)"}
- Decoding settings (`generation_config.json`; a `generate` keyword overrides one for a call):
  {json.dumps(decoding) if decoding else "the package's defaults"}

## Usage

{USAGE.format(cls=cls, target=base_model or "path/to/the/target/model", repo=repo_id or "path/to/this/folder")}

## Training

{_training_section(training)}

## Evaluation (greedy decoding, batch 1)

{_table(evaluation)}
"""
    return ModelCard(content)


BLOCK_SETTINGS = ("block_size", "ttt_steps")  # tokens one drafter forward proposes / training-time-test unroll
TRAINING_ORDER = ("command", "sessions", "hardware", "data", "self_distilled", "datasets", "license", "train_steps",
                  "train_tokens", "total_train_tokens", "train_time_minutes", "train_cpu_minutes", "backfilled",
                  "started_from")  # fmt: skip


def _training_section(training: dict[str, Any]) -> str:
    """The run's record in a fixed order (`TRAINING_ORDER`, then other keys sorted: a saved config sorts its keys);
    commands as shell blocks, one per session after a resume; the record of the drafter the run started from
    (``started_from``) nested below, as its own section."""
    if not training:
        return "_Not trained (freshly initialised weights)._"
    lines = []
    known = [k for k in TRAINING_ORDER if k in training]
    for key, value in ((k, training[k]) for k in known + sorted(set(training) - set(known))):
        if key == "command" and "sessions" in training:
            continue  # each session shows its own command
        if key == "started_from":
            earlier = {k: v for k, v in value.items() if k != "drafter"}
            lines.append(f"- started from the drafter `{value.get('drafter')}`, trained before as follows:")
            lines.extend(f"  {line}" if line else line for line in _training_section(earlier).splitlines())
            continue
        if key == "command":
            lines.append(f"- command:\n\n  ```bash\n  {value}\n  ```")
        elif key == "sessions":
            lines.append(f"- sessions: {len(value)} (the run was resumed from a checkpoint)")
            for i, session in enumerate(value, 1):
                where = f"steps {session.get('steps', '?')}, {session.get('hardware', 'hardware not recorded')}"
                lines.append(f"  - session {i}: {where}\n\n    ```bash\n    {session.get('command')}\n    ```")
        else:
            lines.append(f"- {key}: {value}")
    return "\n".join(lines)
