"""Benchmark: methods run interleaved per prompt in one process, so machine drift hits all of them alike.

`run_benchmark` times plain `target.generate` (the reference) against other decoding methods (prompt lookup,
assisted generation, tree drafters and their ablations) on a prompt set and records, per prompt and method: new
tokens, seconds, tau, drafting / verification time, drafter forwards and nodes per iteration, and whether the greedy
output equals the reference; where it does not, the first differing position and the float32 logit gap between the
two tokens there (`exactness.first_divergence`: in 16-bit a flip at a near-tie is round-off, elsewhere a bug).
Per-prompt rows are appended to `per_prompt.jsonl`, so an interrupted run resumes on the machine that timed them
(`machine.txt`); `report` writes the tables and figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging

from ..generation.op_counter import OpCounts, count_ops
from ..hub.provenance import describe_device
from ..models.tree_drafter.modeling_tree_drafter import TreeDraftModel
from ..utils import check_same_machine
from .exactness import NEAR_TIE_GAP, first_divergence_in_batch, float32_copy

logger = logging.get_logger(__name__)

REFERENCE = "plain"
CONTROL = "plain_control"  # plain `generate` timed again as a method: the A/A ratio that shows a run's noise floor
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # targets whose divergences get a float32 gap


@dataclass
class Method:
    """A decoding method: extra `generate` kwargs, plus tree settings applied to its drafter for the call."""

    name: str
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    tree_settings: dict[str, Any] = field(default_factory=dict)

    def context(self):
        drafter = self.generate_kwargs.get("assistant_model")
        if isinstance(drafter, TreeDraftModel) and self.tree_settings:
            return drafter.tree_settings(**self.tree_settings)
        return nullcontext()


@dataclass
class PromptResult:
    method: str
    prompt_id: str
    category: str
    new_tokens: int
    seconds: float
    identical_to_reference: bool | None
    tau: float | None = None
    iterations: int | None = None
    drafter_time_s: float | None = None
    target_time_s: float | None = None
    drafter_forwards: int | None = None
    nodes_verified: int | None = None
    peak_memory_mb: float | None = None
    target_calls: int | None = None  # target forwards of the whole generate call (prefill included)
    # greedy outputs that left the reference: first differing new token, float32 |logit gap| of the two tokens there
    # (a batch: of its row with the largest gap)
    divergence_position: int | None = None
    fp32_gap: float | None = None
    # count_ops: one more untimed call under `op_counter.count_ops`: loop iterations, aten ops and host syncs per region
    op_counts: dict[str, int] | None = None
    repeat_seconds: list[float] | None = None  # `repeats` > 1: every round's seconds (the row is the median round)


@dataclass
class BenchmarkResults:
    settings: dict[str, Any]
    prompts: list[PromptResult] = field(default_factory=list)

    def summary(self, category: str | None = None) -> dict[str, dict[str, Any]]:
        """Per method: tokens/s, speed-up (tokens/s over the reference's on the same prompts: sampled outputs differ
        in length), tau, shares, exactness (greedy only; None when sampling): whether every output equals the
        reference's, how many left it, and the largest float32 logit gap where they did (a near-tie if small)."""
        rows = [r for r in self.prompts if category is None or r.category == category]
        reference = [r for r in rows if r.method == REFERENCE]
        reference_rate = sum(r.new_tokens for r in reference) / sum(r.seconds for r in reference) if reference else None
        out: dict[str, dict[str, Any]] = {}
        for method in dict.fromkeys(r.method for r in rows):
            mine = [r for r in rows if r.method == method]
            seconds, tokens = sum(r.seconds for r in mine), sum(r.new_tokens for r in mine)
            trees = [r for r in mine if r.iterations]
            iters = sum(r.iterations for r in trees)
            draft_s, verify_s = sum(r.drafter_time_s for r in trees), sum(r.target_time_s for r in trees)
            left = [r for r in mine if r.identical_to_reference is False]
            gaps = [r.fp32_gap for r in left if r.fp32_gap is not None]  # rows of older runs have none
            out[method] = {
                "tokens_per_s": tokens / seconds,
                "speedup": tokens / seconds / reference_rate if reference_rate else None,
                "tau": sum(r.tau * r.iterations for r in trees) / iters if iters else None,
                "drafting_share": draft_s / (draft_s + verify_s) if trees else None,
                "drafter_forwards_per_iter": sum(r.drafter_forwards for r in trees) / iters if iters else None,
                "nodes_per_iter": sum(r.nodes_verified for r in trees) / iters if iters else None,
                "tokens_per_target_call": _tokens_per_call(mine),
                "time_per_iter_ms": _time_split(trees, iters),
                "peak_memory_mb": max((r.peak_memory_mb or 0.0) for r in mine) or None,
                "identical_to_reference": None if self.settings.get("do_sample") else not left,
                "left_greedy": None if self.settings.get("do_sample") else len(left),
                "max_fp32_gap": max(gaps) if gaps else None,
                "ops_per_iter": _ops_per_iter(mine),
                "num_prompts": len(mine),
            }
        return out

    def payload(self) -> dict[str, Any]:
        categories = sorted({r.category for r in self.prompts})
        return {
            "settings": self.settings,
            "methods": self.summary(),
            "per_category": {c: self.summary(c) for c in categories},
            "per_prompt": [asdict(r) for r in self.prompts],
        }


def _tokens_per_call(rows: list[PromptResult]) -> float | None:
    """New tokens per target forward, prefill included: tau's analogue for every method, chains too (plain: ~1)."""
    counted = [r for r in rows if r.target_calls]  # rows of older runs have no count
    return sum(r.new_tokens for r in counted) / sum(r.target_calls for r in counted) if counted else None


def _ops_per_iter(rows: list[PromptResult]) -> dict[str, float] | None:
    """aten ops and host syncs per loop iteration (target forward, drafting, the rest), over every counted prompt."""
    counted = [r.op_counts for r in rows if r.op_counts]
    if not counted:
        return None
    total = OpCounts(iterations=sum(c["iterations"] for c in counted))
    for c in counted:
        total.ops.update({k.removesuffix("_ops"): v for k, v in c.items() if k.endswith("_ops")})
        total.syncs.update({k.removesuffix("_syncs"): v for k, v in c.items() if k.endswith("_syncs")})
    return total.per_iteration()


def _time_split(trees: list[PromptResult], iters: int) -> dict[str, float] | None:
    """Mean milliseconds per iteration spent drafting, verifying and in the rest of the loop."""
    if not iters:
        return None
    draft = sum(r.drafter_time_s for r in trees) / iters * 1e3
    verify = sum(r.target_time_s for r in trees) / iters * 1e3
    total = sum(r.seconds for r in trees) / iters * 1e3
    return {"drafting": draft, "verification": verify, "overhead": max(0.0, total - draft - verify)}


_PROC_STATUS, _PROC_CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def _reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: CUDA's allocator statistics, or (Linux CPU) the process' resident-set high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _PROC_CLEAR_REFS.exists():
        try:
            _PROC_CLEAR_REFS.write_text("5")  # "5" resets VmHWM (see `man 5 proc`)
        except OSError:
            pass


def _peak_memory_mb(device: torch.device) -> float | None:
    """Peak memory since `_reset_peak_memory`: CUDA allocated memory, or the process' peak RSS on a Linux CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if _PROC_STATUS.exists():
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    return None


@contextmanager
def counted_forwards(model: torch.nn.Module) -> Iterator[list[int]]:
    """``[n]``: the forward calls of ``model`` inside the block (a pre-hook; a Python call per forward, the same
    small cost for every method)."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def _generate(target: PreTrainedModel, inputs, method: Method, max_new_tokens: int, do_sample: bool,
              generate_kwargs: dict[str, Any]) -> torch.LongTensor:  # fmt: skip
    with method.context():
        return target.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs, **method.generate_kwargs
        )


def _encode(tokenizer: PreTrainedTokenizerBase, rows: list[dict[str, Any]], device: torch.device):
    """The prompts of `rows` as one left-padded batch (padded with the EOS token where the tokenizer has no pad
    token; its padding settings are restored afterwards)."""
    texts = [
        row.get("text") or tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for row in rows
    ]  # fmt: skip
    if len(texts) == 1:
        return tokenizer(texts, return_tensors="pt", add_special_tokens=False).to(device)
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side, tokenizer.pad_token = "left", pad or tokenizer.eos_token
    try:
        return tokenizer(texts, return_tensors="pt", add_special_tokens=False, padding=True).to(device)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad


def _new_tokens(out: torch.LongTensor, prompt_len: int, eos: set[int]) -> list[list[int]]:
    """Each row's generated tokens, up to and including its first EOS (a finished row's padding dropped)."""
    rows = []
    for tokens in out[:, prompt_len:].tolist():
        end = next((i + 1 for i, token in enumerate(tokens) if token in eos), len(tokens))
        rows.append(tokens[:end])
    return rows


def run_benchmark(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: datasets.Dataset,
    methods: list[Method],
    max_new_tokens: int = 128,
    do_sample: bool = False,
    seed: int = 0,
    output_dir: str | Path | None = None,
    warmup_tokens: int = 32,
    measure_near_ties: bool = True,
    batch_size: int = 1,
    count_ops: bool = False,
    repeats: int = 1,
    **generate_kwargs: Any,
) -> BenchmarkResults:
    """Run the reference and every method on each prompt (interleaved); resumable through `output_dir`.

    `batch_size` > 1: the prompts are grouped into left-padded batches in their order, each batch a unit of the
    interleaving (its row counts all the batch's new tokens); a method that refuses batches (transformers' prompt
    lookup and assisted generation) is recorded in `settings["refused"]` with its error.

    Before timing, every method generates `warmup_tokens` untimed tokens from the first prompt: kernels, allocator
    and one-off measurements (`tree_budget="auto"` times the target once per model and device) are paid there.

    Greedy with `measure_near_ties`: where an output leaves the reference's, its row records the first differing
    position and the float32 logit gap of the two tokens there, measured untimed with the target itself (float32) or,
    for a 16-bit target, with one float32 copy made before the first prompt (so every method's peak memory includes
    that copy alike); in a batch every row is scored alone on its own prompt and the largest gap is kept. A gap above
    `exactness.NEAR_TIE_GAP` is logged as a warning: not explained by round-off.

    `repeats` > 1: each prompt (batch) runs `repeats` rounds of every method, each round starting one method later;
    a method's row is its median round by time (`repeat_seconds` keeps every round's), so one burst of load on a
    shared machine cannot decide a ratio.

    `count_ops`: each method runs each prompt once more, untimed, under `op_counter.count_ops` (aten ops and host
    syncs per iteration inside the target forward, in drafting and in the rest of the loop: `ops_per_iter`). With
    `tree_budget="auto"` that call goes on from the chooser's state, so it may draft other budgets than the timed one.
    """
    settings = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "seed": seed, **generate_kwargs}
    settings |= {"methods": [REFERENCE] + [m.name for m in methods], "num_prompts": len(prompts)}
    settings |= {"batch_size": batch_size, "refused": {}, "repeats": repeats}
    measured = measure_near_ties and not do_sample and target.dtype in FLOAT_DTYPES
    settings["count_ops"] = count_ops
    settings["near_tie_gap"] = NEAR_TIE_GAP if measured else None  # the largest float32 gap counted as a near-tie
    results = BenchmarkResults(settings=settings)
    log = Path(output_dir, "per_prompt.jsonl") if output_dir is not None else None
    if log is not None:
        check_same_machine(output_dir, describe_device(target.device), log.name)
        if log.exists():
            results.prompts = [PromptResult(**json.loads(line)) for line in log.read_text().splitlines() if line]
    done = {(r.prompt_id, r.method) for r in results.prompts}
    groups = [[prompts[i] for i in range(start, min(start + batch_size, len(prompts)))]
              for start in range(0, len(prompts), batch_size)]  # fmt: skip
    generate_kwargs = {"pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id, **generate_kwargs}
    all_methods = [Method(REFERENCE), *methods]
    if batch_size > 1:  # transformers' own assisted paths refuse batches: say so instead of timing them
        inputs = _encode(tokenizer, groups[0], target.device)
        for method in methods:
            try:
                _generate(target, inputs, method, 1, do_sample, generate_kwargs)
            except ValueError as error:
                settings["refused"][method.name] = str(error)
        all_methods = [m for m in all_methods if m.name not in settings["refused"]]
    remaining = len(done) < len(groups) * len(all_methods)
    float32_target = float32_copy(target) if measured and remaining else None  # the target itself if float32
    if warmup_tokens and remaining:
        inputs = _encode(tokenizer, groups[0], target.device)
        for method in tqdm(all_methods, desc="warm-up"):
            torch.manual_seed(seed)
            drafter = method.generate_kwargs.get("assistant_model")
            if isinstance(drafter, TreeDraftModel):  # another method on this drafter object served this prompt
                _forget_served_text(drafter)
            _generate(target, inputs, method, warmup_tokens, do_sample, generate_kwargs)
    for group in tqdm(groups, desc="benchmark prompts" if batch_size == 1 else "benchmark batches"):
        prompt_id = "+".join(str(row["id"]) for row in group)
        if all((prompt_id, m.name) in done for m in all_methods):
            continue
        results.prompts = [r for r in results.prompts if r.prompt_id != prompt_id]  # redo a half-done prompt
        inputs = _encode(tokenizer, group, target.device)
        categories = {row["category"] for row in group}
        category = categories.pop() if len(categories) == 1 else "mixed"
        reference: list[list[int]] | None = None
        rounds: dict[str, list[tuple[PromptResult, list[list[int]]]]] = {m.name: [] for m in all_methods}
        for round_index in range(repeats):  # each round runs every method once, starting one method later
            for method in all_methods[round_index % len(all_methods) :] + all_methods[: round_index % len(all_methods)]:
                result, tokens = _timed_call(target, inputs, method, max_new_tokens, do_sample, seed, generate_kwargs)
                reference = tokens if method.name == REFERENCE and reference is None else reference
                result.prompt_id, result.category = prompt_id, category
                rounds[method.name].append((result, tokens))
        new_rows = []
        for method in all_methods:
            by_time = sorted(rounds[method.name], key=lambda entry: entry[0].seconds)
            result, tokens = by_time[(len(by_time) - 1) // 2]  # the median round (the lower one of two)
            result.identical_to_reference = None if do_sample else all(t == reference for _, t in by_time)
            result.repeat_seconds = [r.seconds for r, _ in rounds[method.name]]
            if float32_target is not None and tokens != reference:  # untimed: after the peak memory is read
                divergence = first_divergence_in_batch(float32_target, inputs["input_ids"],
                                                       inputs.get("attention_mask"), reference, tokens)  # fmt: skip
                result.divergence_position, result.fp32_gap = divergence.position, divergence.fp32_gap
                if not divergence.is_near_tie():
                    logger.warning(
                        f"{method.name} left plain greedy on prompt {prompt_id} at new token {divergence.position} "
                        f"with a float32 logit gap of {divergence.fp32_gap:.3g} (> {NEAR_TIE_GAP}): not a near-tie."
                    )
            if count_ops:  # untimed, after everything else was measured
                result.op_counts = _counted_run(
                    target, inputs, method, max_new_tokens, do_sample, seed, generate_kwargs
                )
            new_rows.append(result)
        results.prompts += new_rows
        if log is not None:
            with log.open("a") as sink:
                sink.writelines(json.dumps(asdict(r)) + "\n" for r in new_rows)
    return results


def _timed_call(
    target: PreTrainedModel, inputs, method: Method, max_new_tokens: int, do_sample: bool, seed: int,
    generate_kwargs: dict[str, Any],
) -> tuple[PromptResult, list[list[int]]]:  # fmt: skip
    """One timed generate call of `method` (its drafter's statistics and peak memory with it) and its new tokens."""
    torch.manual_seed(seed)
    _reset_peak_memory(target.device)
    drafter = method.generate_kwargs.get("assistant_model")
    if isinstance(drafter, TreeDraftModel):  # a chain run (speculation_type) leaves no tree statistics
        drafter.last_stats = None
        _forget_served_text(drafter)
    with counted_forwards(target) as target_calls:
        start = time.perf_counter()
        out = _generate(target, inputs, method, max_new_tokens, do_sample, generate_kwargs)
        seconds = time.perf_counter() - start
    tokens = _new_tokens(out, inputs["input_ids"].shape[1], set(_as_list(target.generation_config.eos_token_id)))
    stats = drafter.last_stats if isinstance(drafter, TreeDraftModel) else None
    result = PromptResult(
        method=method.name, prompt_id="", category="", new_tokens=sum(len(row_tokens) for row_tokens in tokens),
        seconds=seconds, identical_to_reference=None,
        tau=stats.tau if stats else None,
        iterations=stats.iterations if stats else None,
        drafter_time_s=stats.drafter_time_s if stats else None,
        target_time_s=stats.target_time_s if stats else None,
        drafter_forwards=stats.drafter_forwards if stats else None,
        nodes_verified=sum(stats.nodes_per_iteration) if stats else None,
        peak_memory_mb=_peak_memory_mb(target.device),
        target_calls=target_calls[0],
    )  # fmt: skip
    return result, tokens


def _forget_served_text(drafter: TreeDraftModel) -> None:
    """Every timed call (and every warm-up call) serves its prompt as a first request: the suffix cache's memory of
    earlier calls (the warm-up, another method on the same drafter object, this prompt) would let it copy an answer
    to this very prompt - and "auto" would learn from the warm-up that trees pay. The cross-request memory is
    measured on request streams instead (`examples/suffix_streams.py`)."""
    store = drafter.serving_states.suffix_store
    if store is not None:
        store.reset()


def _as_list(ids: int | list[int] | None) -> list[int]:
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
def _counted_run(target: PreTrainedModel, inputs, method: Method, max_new_tokens: int, do_sample: bool, seed: int,
                 generate_kwargs: dict[str, Any]) -> dict[str, int]:  # fmt: skip
    """The same call once more under `count_ops`: its iterations, and aten ops / host syncs per region."""
    torch.manual_seed(seed)
    if isinstance(method.generate_kwargs.get("assistant_model"), TreeDraftModel):
        _forget_served_text(method.generate_kwargs["assistant_model"])
    with count_ops(target) as counts:
        _generate(target, inputs, method, max_new_tokens, do_sample, generate_kwargs)
    return {"iterations": counts.iterations, **{f"{k}_ops": v for k, v in counts.ops.items()},
            **{f"{k}_syncs": v for k, v in counts.syncs.items()}}  # fmt: skip
