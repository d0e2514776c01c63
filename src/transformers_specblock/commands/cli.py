"""Command-line entry points of transformers-specblock.

* ``specblock-train``: `train_command` (`train_main`; also ``accelerate launch -m transformers_specblock.train ...``
  or ``torchrun -m transformers_specblock.train ...``).
* ``specblock-bench``: `bench_command` (`bench_main`).
* ``specblock-convert``: `commands.convert.main` (drafter checkpoints to / from the published EAGLE-3 and SpecBlock
  reference layouts).

The ``*_main`` functions raise; the ``*_command`` console scripts print a user error as one paragraph
(`commands.errors`).
"""

from __future__ import annotations

import itertools
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from transformers import AutoModel, HfArgumentParser

from ..hub.assets import explain_hub_errors
from ..hub.prompts import load_prompts
from ..hub.loading import DEVICE_HELP, DTYPE_CHOICES, DTYPE_HELP, load_model
from ..hub.provenance import describe_device
from ..hub.shipped import SHIPPED_DRAFTERS, resolve_drafter_path
from .benchmark import CONTROL, REFERENCE, Method, run_benchmark
from .report import write_report
from .errors import command
from ..models.lookup_tree.modeling_lookup_tree import LookupTreeModel
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..training import parse_train_args, run_training


def train_main(argv: Sequence[str] | None = None) -> None:
    """``specblock-train``: train a SpecBlock drafter for a target with `transformers.Trainer`.

    Example::

        specblock-train --target_model smollm2-135m-instruct --dataset sharegpt --output_dir out/drafter \\
            --block_size 4 --num_blocks 3 --max_steps 2000 --per_device_train_batch_size 4 --learning_rate 3e-4

    Every `transformers.TrainingArguments` option works (``--eval_strategy steps --eval_steps 200``,
    ``--save_steps``, ``--resume_from_checkpoint``, ``--bf16``, ...); see ``specblock-train --help``.
    ``--target_model`` takes a packaged name, a local folder or a Hub id; ``--device`` / ``--dtype`` place the
    frozen target (the drafter trains where `TrainingArguments` puts it, in float32 weights; ``--bf16`` is its mixed
    precision).
    ``--do_train false --init_drafter FOLDER`` only evaluates a saved drafter on ``--eval_dataset``.
    Metrics land in ``<output_dir>/all_results.json`` and ``trainer_state.json``; call
    `transformers_specblock.training.run_training` to get the trainer object instead.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    model_args, data_args, training_args = parse_train_args(argv)
    trainer = run_training(model_args, data_args, training_args, command="specblock-train " + shlex.join(argv))
    # Under torchrun, no process may exit while another still saves; then the process group closes cleanly (a
    # process leaving with its group open can abort at interpreter exit).
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


@dataclass
class BenchArguments:
    target_model: str = field(
        metadata={"help": "Target: a packaged model name, a local model folder or a Hugging Face Hub id."}
    )
    device: str | None = field(default=None, metadata={"help": DEVICE_HELP + " Drafters follow the target."})
    dtype: str = field(
        default="auto", metadata={"help": DTYPE_HELP + " Drafters run in the target's dtype.", "choices": DTYPE_CHOICES}
    )
    methods: str = field(
        default="plain,prompt_lookup,specblock",
        metadata={
            "help": "Comma list of: plain (always run, the reference), plain_control (plain `generate` timed once more "
            "as if it were a method: its ratio to plain is the run's noise floor), prompt_lookup (transformers'), "
            "assisted, specblock (as shipped), specblock_fixed_tree, specblock_one_block / specblock_two_blocks / "
            "specblock_three_blocks (1, 2 or 3 block rounds), eagle3_depth6 (EAGLE-3 drafting 6 levels deep), "
            "specblock_reference / "
            "specblock_reference_one_block (the trees grown as the method's reference implementation grows them, "
            "tree_construction='reference', two or one block rounds), eagle3, lookup_tree (prompt lookup and an "
            "n-gram cache as a tree, no drafter), specblock+lookup, eagle3+lookup (the drafter's tree with those free "
            "candidates), dflash (a DFlash drafter's best-first tree), dflash_chain (the same drafter in "
            "transformers' own speculation_type='dflash' chain), specblock_compiled / eagle3_compiled / "
            "dflash_compiled (the drafter's forwards under torch.compile, compile_drafter=True); a tree method may "
            "name its budget, e.g. specblock@4,specblock+lookup@auto."
        },
    )
    dataset: str = field(default="mt_bench", metadata={"help": "mt_bench, humaneval, sharegpt or a JSONL file."})
    num_prompts: int | None = field(default=8)
    max_new_tokens: int = field(default=128)
    output_dir: str = field(default="out/bench")
    specblock_model: str | None = field(
        default=None,
        metadata={"help": "SpecBlock drafter: a shipped drafter name, a local folder or a Hub id; default: the "
                  "shipped specblock-<target_model folder name>."},
    )
    eagle3_model: str | None = field(
        default=None,
        metadata={"help": "EAGLE-3 drafter: a shipped drafter name, a local folder or a Hub id; default: the "
                  "shipped eagle3-<target_model folder name>."},
    )
    dflash_model: str | None = field(
        default=None,
        metadata={"help": "DFlash drafter (methods dflash, dflash_chain): a shipped drafter name, a local folder or a "
                  "Hub id; default: the shipped dflash-<target_model folder name>."},
    )
    assistant_model: str | None = field(
        default=None,
        metadata={"help": "Small LM for transformers' assisted generation: a packaged name, a local folder or a Hub "
                  "id (loaded on the target's device, in its dtype)."},
    )
    prompt_lookup_num_tokens: int = field(
        default=10, metadata={"help": "Tokens per prompt-lookup chain (transformers' prompt_lookup and the tree's)."}
    )
    ngram_cache_num_tokens: int = field(
        default=8, metadata={"help": "Tokens per n-gram-cache chain of lookup_tree and the +lookup methods (0 = off)."}
    )
    tree_budget: str | None = field(
        default=None, metadata={"help": 'Override the drafters\' tree budget (an int or "auto").'}
    )
    warmup_tokens: int = field(default=32, metadata={"help": "Untimed tokens per method before timing starts."})
    batch_size: int = field(
        default=1, metadata={"help": "Prompts per generate call (left-padded batches, grouped in prompt order)."}
    )
    repeats: int = field(
        default=1, metadata={"help": "Rounds of every method per prompt (batch), each starting one method later; a "
                             "method's row is its median round (a shared machine's bursts of load)."},
    )
    do_sample: bool = field(default=False)
    temperature: float = field(default=1.0)
    seed: int = field(default=0)
    near_ties: bool = field(
        default=True,
        metadata={"help": "Greedy: where a method's output leaves plain greedy, record the float32 logit gap of the "
                  "two tokens there (columns left_greedy, max_fp32_gap; a 16-bit target gets one float32 copy for "
                  "it). --no_near_ties skips it (and the copy's memory)."},
    )
    count_ops: bool = field(
        default=False,
        metadata={"help": "Also run every method once more per prompt, untimed, counting aten ops (kernel launches) "
                  "and host syncs per iteration inside the target forward, in drafting and in the rest of the loop."},
    )


def default_drafter_name(kind: str, target_model: str) -> str:
    """``<kind>-<target folder name>``: the shipped drafter's name for a packaged target (see `hub.shipped`)."""
    return f"{kind}-{Path(target_model).name}"


def load_bench_drafter(path: str | None, kind: str, target_model: str, target) -> TreeDraftModel:
    """A drafter (shipped name, local folder or Hub id; default: the shipped one named after the target) in the
    target's dtype, bound to the target, which puts it on the target's (input) device."""
    name_or_path = path or default_drafter_name(kind, target_model)
    if path is None and not Path(resolve_drafter_path(name_or_path), "config.json").exists():
        raise FileNotFoundError(
            f"No {kind} drafter {name_or_path!r}: neither a local drafter folder nor a shipped drafter "
            f"({', '.join(SHIPPED_DRAFTERS)}). Pass --{kind}_model with a drafter: a shipped name, a local folder "
            "or a Hub id."
        )
    folder = Path(resolve_drafter_path(name_or_path))
    if folder.is_dir() and not (folder / "config.json").exists():
        steps = {int(p.name[11:]): p for p in folder.glob("checkpoint-*") if p.name[11:].isdigit()}
        hint = f" Its latest training checkpoint loads as a drafter: {steps[max(steps)]}." if steps else ""
        raise FileNotFoundError(
            f"--{kind}_model {name_or_path}: the folder has no config.json, so it holds no saved drafter (a training "
            f"run writes it at the end).{hint}"
        )
    shipped = f"a shipped drafter ({', '.join(SHIPPED_DRAFTERS)})"
    with explain_hub_errors(name_or_path, kind=f"{kind} drafter", names=shipped):
        # a local folder wins over a shipped drafter's name; a Hub id passes through unchanged
        drafter = AutoModel.from_pretrained(resolve_drafter_path(name_or_path), dtype=target.dtype).eval()
    drafter.bind_target(target)
    return drafter


TREE_METHODS = {
    "specblock": ("specblock", {}),
    "specblock_fixed_tree": ("specblock", {"tree_policy": "fixed"}),
    "specblock_one_block": ("specblock", {"max_blocks": 1}),
    "specblock_two_blocks": ("specblock", {"max_blocks": 2}),
    "specblock_three_blocks": ("specblock", {"max_blocks": 3}),
    "specblock_reference": ("specblock", {"tree_construction": "reference"}),
    "specblock_reference_one_block": ("specblock", {"tree_construction": "reference", "max_blocks": 1}),
    "eagle3": ("eagle3", {}),
    "eagle3_depth6": ("eagle3", {"tree_depth": 6}),
    "lookup_tree": ("lookup_tree", {}),
    "specblock+lookup": ("specblock", {"lookup": True}),
    "eagle3+lookup": ("eagle3", {"lookup": True}),
    "dflash": ("dflash", {}),
    "specblock_compiled": ("specblock", {"compile_drafter": True}),
    "eagle3_compiled": ("eagle3", {"compile_drafter": True}),
    "dflash_compiled": ("dflash", {"compile_drafter": True}),
}


def parse_tree_budget(text: str) -> int | str:
    """A command-line tree budget: "auto" or a positive int."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f'A tree budget must be a positive int or "auto", got {text!r}.')
    return int(text)


def build_methods(args: BenchArguments, target) -> list[Method]:
    """The `Method`s named in `args.methods` (the plain reference is added by `run_benchmark`).

    A tree method may carry its own budget after an ``@``: ``specblock@4,specblock@16,specblock@auto``.
    """
    specs = [n.strip() for n in args.methods.split(",") if n.strip() and n.strip() != REFERENCE]
    drafters: dict[str, TreeDraftModel] = {}
    methods = []
    for spec in specs:
        name, _, budget = spec.partition("@")
        if budget and name not in TREE_METHODS:
            raise ValueError(f"{spec!r}: only tree methods ({', '.join(TREE_METHODS)}) take an @budget.")
        if name == CONTROL:  # plain generate under another name: what a method doing plain's work measures
            methods.append(Method(spec))
        elif name == "prompt_lookup":
            methods.append(Method(spec, {"prompt_lookup_num_tokens": args.prompt_lookup_num_tokens}))
        elif name == "assisted":
            if not args.assistant_model:
                raise ValueError("--methods assisted needs --assistant_model (e.g. qwen2.5-coder-0.5b-instruct).")
            assistant, _ = load_model(args.assistant_model, device=str(target.device), dtype=target.dtype)
            methods.append(Method(spec, {"assistant_model": assistant}))
        elif name == "dflash_chain":  # transformers' own DFlash path (a chain), same drafter as "dflash"
            if "dflash" not in drafters:
                drafters["dflash"] = load_bench_drafter(args.dflash_model, "dflash", args.target_model, target)
            methods.append(Method(spec, {"assistant_model": drafters["dflash"], "speculation_type": "dflash"}))
        elif name in TREE_METHODS:
            kind, settings = TREE_METHODS[name]
            with_lookup = kind == "lookup_tree" or settings.get("lookup", False)
            settings = {key: value for key, value in settings.items() if key != "lookup"}
            if kind not in drafters and kind == "lookup_tree":
                drafters[kind] = LookupTreeModel.from_target(target)
            elif kind not in drafters:
                path = {"eagle3": args.eagle3_model, "dflash": args.dflash_model}.get(kind, args.specblock_model)
                drafters[kind] = load_bench_drafter(path, kind, args.target_model, target)
            if with_lookup:
                settings = settings | {
                    "prompt_lookup_num_tokens": args.prompt_lookup_num_tokens,
                    "ngram_cache_num_tokens": args.ngram_cache_num_tokens,
                }
            budget = budget or args.tree_budget
            settings = settings | ({"tree_budget": parse_tree_budget(budget)} if budget else {})
            methods.append(Method(spec, {"assistant_model": drafters[kind]}, settings))
        else:
            raise ValueError(f"Unknown method {name!r}; see --help for the choices.")
    return methods


def spread_over_categories(prompts: datasets.Dataset, num_prompts: int | None) -> datasets.Dataset:
    """The first `num_prompts` prompts taken round-robin over categories (MT-Bench lists its 8 in blocks of 10)."""
    if num_prompts is None or num_prompts >= len(prompts):
        return prompts
    by_category: dict[str, list[int]] = {}
    for index, category in enumerate(prompts["category"]):
        by_category.setdefault(category, []).append(index)
    order = [i for group in itertools.zip_longest(*by_category.values()) for i in group if i is not None]
    return prompts.select(order[:num_prompts])


def bench_main(argv: Sequence[str] | None = None) -> None:
    """``specblock-bench``: compare decoding methods on real prompts; writes results.json / results.md / figures.

    Example::

        specblock-bench --target_model smollm2-135m-instruct --methods plain,prompt_lookup,specblock \\
            --dataset mt_bench --num_prompts 8 --max_new_tokens 128 --output_dir out/bench

    On a GPU: ``--target_model meta-llama/Llama-3.1-8B-Instruct --specblock_model <drafter> --device cuda``
    (``--dtype auto``: the checkpoint's bfloat16); ``--device auto`` spreads a larger target over all GPUs.
    """
    (args,) = HfArgumentParser(BenchArguments).parse_args_into_dataclasses(args=argv)
    target, tokenizer = load_model(args.target_model, device=args.device, dtype=args.dtype)
    prompts = spread_over_categories(load_prompts(args.dataset, tokenizer=tokenizer), args.num_prompts)
    methods = build_methods(args, target)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    sampling = {"temperature": args.temperature, "top_k": None, "top_p": None} if args.do_sample else {}
    results = run_benchmark(
        target, tokenizer, prompts, methods, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
        seed=args.seed, output_dir=args.output_dir, warmup_tokens=args.warmup_tokens,
        measure_near_ties=args.near_ties, batch_size=args.batch_size, count_ops=args.count_ops, repeats=args.repeats,
        **sampling,
    )  # fmt: skip
    results.settings |= {"target_model": args.target_model, "dataset": args.dataset}
    results.settings |= {"device": str(target.device), "dtype": str(target.dtype).removeprefix("torch.")}
    results.settings |= {"hardware": describe_device(target.device)}  # a CPU's flags decide whether bf16 pays
    write_report(results, args.output_dir)
    print((Path(args.output_dir) / "results.md").read_text())


train_command = command("specblock-train", train_main)
bench_command = command("specblock-bench", bench_main)
