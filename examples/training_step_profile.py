"""Where one training step of a drafter goes: the frozen target, the drafter's forward and backward, the optimizer.

    python examples/training_step_profile.py --drafter specblock --dtype bfloat16 --output docs/results/X

One step of batch 2 x ``--max_length`` (the first two ShareGPT train conversations long enough to fill it), from
the shipped drafter, the campaign recipe (SpecBlock: K 4, a follow-up block at offset 2, slot-0 normalisation),
online target features. ``--dtype bfloat16`` runs the target in bfloat16 and the drafter under bfloat16 autocast
(what ``--dtype bfloat16 --bf16`` does in training). A warm-up step first, then ``torch.profiler`` over
``--steps`` steps: seconds per phase and the ops with the most self CPU time, printed and written to
``OUTPUT/profile-DRAFTER-DTYPE.json``. Timings on a shared machine: compare phases within one profile.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from transformers_specblock.hub.loading import load_model
from transformers_specblock.training import SpecBlockDataCollator, SpecBlockLossConfig, load_conversations
from transformers_specblock.training.arguments import SpecBlockTrainingArguments
from transformers_specblock.training.data import render_conversation
from transformers_specblock.training.run import DRAFTERS
from transformers_specblock.training.trainer import SpecBlockTrainer

PHASES = ("target", "drafter forward", "drafter backward", "optimizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", choices=sorted(DRAFTERS), default="specblock")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output", default=None, help="Folder for the JSON record (default: print only).")
    options = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    target, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype=options.dtype)
    model = DRAFTERS[options.drafter][1].from_pretrained(f"{options.drafter}-smollm2-135m-instruct").float()
    rows = []
    for messages in load_conversations("sharegpt", 200):
        row = render_conversation(messages, tokenizer, options.max_length)
        if row is not None and len(row["input_ids"]) == options.max_length:
            rows.append(row)
        if len(rows) == 2:
            break
    model.bind_target(target, place=False)  # the drafter stays float32 (bfloat16 only under autocast)
    bf16 = options.dtype == "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        args = SpecBlockTrainingArguments(
            output_dir=tmp, use_cpu=True, bf16=bf16, report_to="none", slot_normalization="slot0"
        )
        if options.drafter == "specblock":
            model.loss_config = SpecBlockLossConfig.from_args(args)
        trainer = SpecBlockTrainer(model=model, args=args, target=target, num_blocks=2, place_target=False)
        optimizer = trainer.create_optimizer()
        batch = SpecBlockDataCollator(pad_token_id=tokenizer.pad_token_id or 0)(rows)
        offsets = [2] if options.drafter == "specblock" else []
        autocast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()

        def step() -> None:
            with record_function("target"):
                inputs = trainer.target_batch(model, batch)
            extra = {"training_step": 1} if options.drafter == "specblock" else {}
            with record_function("drafter forward"), autocast:
                loss = model(**inputs, **extra, followup_offsets=offsets).loss
            with record_function("drafter backward"):
                loss.backward()
            with record_function("optimizer"):
                optimizer.step()
                optimizer.zero_grad()

        step()  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(options.steps):
                step()
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total / 1e6 / options.steps for e in events if e.key in PHASES}
    top = sorted((e for e in events if e.key not in PHASES), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    record = {
        "drafter": options.drafter, "dtype": options.dtype, "batch": "2 x %d" % options.max_length,
        "seconds_per_step": {p: round(phases.get(p, 0.0), 3) for p in PHASES},
        "top_ops_self_seconds_per_step": {e.key: round(e.self_cpu_time_total / 1e6 / options.steps, 3) for e in top},
    }  # fmt: skip
    print(json.dumps(record, indent=1))
    if options.output:
        out = Path(options.output)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{options.drafter}-{options.dtype}.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
