"""Training tokens/s of two versions of the package, interleaved: A/B/A/B runs of a few steps each, both drafters.

    python examples/training_ab_throughput.py --source before=/tmp/old/src --source after=src \
        --output docs/results/X --rounds 3 --steps 2

Each run is one process (one thread) importing the package from its ``--source`` folder: the shipped drafter, batch
2 x ``--max_length`` (the first two ShareGPT train conversations that fill it), online target features, the campaign
recipe (SpecBlock: K 4, one follow-up block at offset 2, slot-0 normalisation; EAGLE-3: 7 unrolled steps),
``--dtype bfloat16`` = target in bfloat16 and the drafter under bfloat16 autocast (what ``--bf16`` does). A warm-up
step, then ``--steps`` timed steps (target, drafter forward and backward, optimizer). Runs alternate between the
sources within a round and the order flips every round, so load from other processes hits both alike: read the
ratios. Writes ``OUTPUT/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def worker(drafter: str, dtype: str, max_length: int, steps: int) -> dict:
    """One run in this process: seconds per timed step and training tokens/s."""
    import contextlib
    import tempfile

    import torch

    from transformers_specblock.hub.loading import load_model
    from transformers_specblock.training import SpecBlockDataCollator, SpecBlockLossConfig, load_conversations
    from transformers_specblock.training.arguments import SpecBlockTrainingArguments
    from transformers_specblock.training.data import render_conversation
    from transformers_specblock.training.run import DRAFTERS
    from transformers_specblock.training.trainer import SpecBlockTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    target, tokenizer = load_model("smollm2-135m-instruct", device="cpu", dtype=dtype)
    model = DRAFTERS[drafter][1].from_pretrained(f"{drafter}-smollm2-135m-instruct").float()
    rows = []
    for messages in load_conversations("sharegpt", 200):
        row = render_conversation(messages, tokenizer, max_length)
        if row is not None and len(row["input_ids"]) == max_length:
            rows.append(row)
        if len(rows) == 2:
            break
    model.bind_target(target, place=False)
    bf16 = dtype == "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        args = SpecBlockTrainingArguments(
            output_dir=tmp, use_cpu=True, bf16=bf16, report_to="none", slot_normalization="slot0"
        )
        if drafter == "specblock":
            model.loss_config = SpecBlockLossConfig.from_args(args)
        trainer = SpecBlockTrainer(model=model, args=args, target=target, num_blocks=2, place_target=False)
        optimizer = trainer.create_optimizer()
        batch = SpecBlockDataCollator(pad_token_id=tokenizer.pad_token_id or 0)(rows)
        offsets = [2] if drafter == "specblock" else []
        extra = {"training_step": 1} if drafter == "specblock" else {}
        autocast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
        times = []
        for i in range(steps + 1):
            start = time.perf_counter()
            inputs = trainer.target_batch(model, batch)
            with autocast:
                loss = model(**inputs, **extra, followup_offsets=offsets).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if i:  # the first step warms up
                times.append(time.perf_counter() - start)
    tokens = int(batch["attention_mask"].sum())
    return {"seconds_per_step": times, "tokens_per_step": tokens, "tokens_per_second": tokens / statistics.mean(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", required=True, help="NAME=PATH of a package source folder.")
    parser.add_argument("--drafters", nargs="+", default=["specblock", "eagle3"])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        print(json.dumps(worker(options.worker, options.dtype, options.max_length, options.steps)))
        return
    sources = dict(item.split("=", 1) for item in options.source)
    names = list(sources)
    runs = []
    for rnd in range(options.rounds):
        for drafter in options.drafters:
            for name in names if rnd % 2 == 0 else names[::-1]:
                env = {**os.environ, "PYTHONPATH": str(Path(sources[name]).resolve()), "OMP_NUM_THREADS": "1"}
                command = [sys.executable, __file__, "--source", "x=x", "--worker", drafter, "--dtype", options.dtype,
                           "--max_length", str(options.max_length), "--steps", str(options.steps)]  # fmt: skip
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
                record = {"round": rnd, "drafter": drafter, "source": name, "load": os.getloadavg()[0],
                          **json.loads(out.strip().splitlines()[-1])}  # fmt: skip
                runs.append(record)
                print(json.dumps(record), flush=True)
                if options.output:
                    path = Path(options.output)
                    path.mkdir(parents=True, exist_ok=True)
                    tmp = path / "results.json.tmp"
                    tmp.write_text(json.dumps({"sources": sources, "dtype": options.dtype, "runs": runs}, indent=1))
                    tmp.replace(path / "results.json")


if __name__ == "__main__":
    main()
