"""An exception leaves every object usable, one drafter serves one generate call at a time, and batched regeneration
answers as single-prompt greedy `generate` does.

* `tree_settings` restores the config after an exception inside its block (or a setting it refuses).
* A `generate` interrupted by an exception from a stopping criterion or a streamer leaves the drafter usable: the
  next calls equal plain greedy, with `tree_budget="auto"`, free candidates and online adaptation on.
* Two threads calling `generate` with ONE drafter object: the second call, while the first is drafting, is a
  RuntimeError saying so (`generation.integration.serving`); the running call is unaffected and equals plain greedy.
  This is the documented rule (README "Limits"): a drafter holds per-call and cross-call state (its KV cache,
  the "auto" estimates, online adaptation's signal and in-place weight updates), so give each thread its own.
"""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import transformers_specblock
from conftest import make_drafter, make_target
from test_regenerate import model_dir  # noqa: F401  (fixture: a tiny chat model folder)
from transformers_specblock import LookupTreeModel
from transformers_specblock.commands.regenerate import RegenerateArguments, regenerate
from transformers_specblock.hub.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 24
PROMPT = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
SETTINGS = {
    "fixed": dict(tree_budget=16),
    "auto+lookup+adaptation": dict(tree_budget="auto", prompt_lookup_num_tokens=6, ngram_cache_num_tokens=4,
                                   online_adaptation="always"),  # fmt: skip
    "head_only+lookup": dict(tree_budget=16, prompt_lookup_num_tokens=6, online_adaptation="head_only"),
}


@pytest.fixture(scope="module")
def target():
    return make_target("llama", vocab_size=VOCAB, seed=0)


@pytest.fixture(scope="module")
def plain(target):
    return target.generate(PROMPT, do_sample=False, max_new_tokens=40)


class Interrupted(Exception):
    """What the failing stopping criterion / streamer raises."""


class FailingCriterion(StoppingCriteria):
    def __init__(self, after: int) -> None:
        self.calls, self.after = 0, after

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > self.after:
            raise Interrupted("stopping criterion")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class FailingStreamer(BaseStreamer):
    def __init__(self, after: int) -> None:
        self.puts, self.after = 0, after

    def put(self, value) -> None:
        self.puts += 1
        if self.puts > self.after:
            raise Interrupted("streamer")

    def end(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ tree_settings
def test_tree_settings_are_restored_after_an_exception(target):
    drafter = make_drafter(target, tree_budget=16)
    before = drafter.config.to_dict()
    with pytest.raises(Interrupted):
        with drafter.tree_settings(tree_budget=4, prompt_lookup_num_tokens=5, online_adaptation="head_only"):
            assert drafter.generation_config.tree_budget == 4
            raise Interrupted
    assert drafter.config.to_dict() == before
    with pytest.raises(ValueError):  # a refused value: nothing of the block's settings stays
        with drafter.tree_settings(tree_budget=8, prompt_lookup_num_tokens=-3):
            pass
    assert drafter.config.to_dict() == before
    with pytest.raises(Interrupted):  # an exception from generate itself, inside the block
        with drafter.tree_settings(tree_budget=4):
            target.generate(PROMPT, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                            stopping_criteria=StoppingCriteriaList([FailingCriterion(3)]))  # fmt: skip
    assert drafter.config.to_dict() == before


# ------------------------------------------------------------------------------------------------ interrupted calls
@pytest.mark.parametrize("interrupt", ["stopping_criterion", "streamer"])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_an_interrupted_generate_leaves_the_drafter_usable(target, plain, settings, interrupt):
    drafter = make_drafter(target, **SETTINGS[settings])
    failing = (dict(stopping_criteria=StoppingCriteriaList([FailingCriterion(5)])) if interrupt == "stopping_criterion"
               else dict(streamer=FailingStreamer(4)))  # fmt: skip
    target.generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter)  # state from a whole call
    with pytest.raises(Interrupted):
        target.generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter, **failing)
    for _ in range(2):
        out = target.generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter)
        assert out.tolist() == plain.tolist()
        assert drafter.last_stats.new_tokens == 40
    if settings == "fixed":  # no state carries over between calls: the same trees as a drafter never interrupted
        fresh = make_drafter(target, **SETTINGS[settings])
        target.generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=fresh)
        assert fresh.last_stats.accepted_per_iteration == drafter.last_stats.accepted_per_iteration


# ------------------------------------------------------------------------------------------------ threads
class WaitingStreamer(BaseStreamer):
    """Holds its call at the first chunk until `release` is set (so another thread runs meanwhile)."""

    def __init__(self, started: threading.Event, release: threading.Event) -> None:
        self.started, self.release, self.puts = started, release, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:  # the prompt, then the first generated chunk
            self.started.set()
            assert self.release.wait(timeout=120)

    def end(self) -> None:
        pass


@pytest.mark.parametrize("route", ["patched", "function"])
@pytest.mark.parametrize("kind", ["specblock", "lookup_tree"])
def test_a_second_thread_gets_a_clear_error_and_the_first_is_unaffected(target, plain, route, kind):
    drafter = make_drafter(target, **SETTINGS["auto+lookup+adaptation"]) if kind == "specblock" else (
        LookupTreeModel.from_target(target))  # fmt: skip
    if route == "patched":
        generate = target.generate
    else:
        def generate(*args, **kwargs):
            return transformers_specblock.generate(target, *args, **kwargs)
    started, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        try:
            results["first"] = generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter,
                                        streamer=WaitingStreamer(started, release))  # fmt: skip
        except BaseException as error:  # reported below
            results["first"] = error

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(timeout=120)
    try:
        with pytest.raises(RuntimeError, match="already drafting for another generate call .* its own drafter"):
            generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter)
    finally:
        release.set()
        thread.join(timeout=300)
    assert isinstance(results["first"], torch.Tensor), results["first"]
    assert results["first"].tolist() == plain.tolist()
    # released: the next call (this thread) runs
    assert generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter).tolist() == plain.tolist()


def test_generate_from_a_streamer_with_the_same_drafter_is_refused(target, plain):
    drafter = make_drafter(target, tree_budget=16)
    errors = []

    class Reentrant(BaseStreamer):
        def put(self, value) -> None:
            if not errors:
                try:
                    target.generate(PROMPT, do_sample=False, max_new_tokens=4, assistant_model=drafter)
                except RuntimeError as error:
                    errors.append(error)

        def end(self) -> None:
            pass

    out = target.generate(PROMPT, do_sample=False, max_new_tokens=40, assistant_model=drafter, streamer=Reentrant())
    assert out.tolist() == plain.tolist()
    assert errors and "already drafting" in str(errors[0])


def test_many_threads_get_exact_output_or_the_clear_error(target):
    """Free-running threads on one drafter (with adaptation, whose concurrent in-place updates used to fail deep
    in autograd): every call returns plain greedy or raises the RuntimeError, nothing else."""
    drafter = make_drafter(target, **SETTINGS["auto+lookup+adaptation"])
    prompts = [torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    expected = [target.generate(p, do_sample=False, max_new_tokens=30).tolist() for p in prompts]
    outcomes: list[object] = []

    def work(i: int) -> None:
        for _ in range(3):
            try:
                out = target.generate(prompts[i], do_sample=False, max_new_tokens=30, assistant_model=drafter)
                outcomes.append(out.tolist() == expected[i])
            except Exception as error:  # checked below
                outcomes.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    other = [o for o in outcomes if not (o is True or (isinstance(o, RuntimeError) and "already drafting" in str(o)))]
    assert len(outcomes) == 12 and not other, other
    assert any(o is True for o in outcomes)


# ------------------------------------------------------------------------------------------------ regeneration
def test_batched_regeneration_equals_single_prompt_greedy(tmp_path, model_dir):  # noqa: F811
    output = tmp_path / "regen.jsonl"
    args = RegenerateArguments(target_model=str(model_dir), output=str(output), num_conversations=6, max_new_tokens=12,
                               batch_size=3, max_prompt_tokens=120, sampled_fraction=0.0)  # fmt: skip
    regenerate(args)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(lines) == 6
    target, tokenizer = load_model(str(model_dir), device="cpu", dtype="float32")
    lengths = set()
    for line in lines:
        question = line["conversations"][0]["value"]
        chat = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        lengths.add(ids.shape[1])
        single = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                 top_p=None, top_k=None, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        answer = tokenizer.decode(single[0, ids.shape[1] :], skip_special_tokens=True).strip()
        assert line["conversations"][1]["value"] == answer, line["id"]
    assert len(lengths) > 1  # prompts of different lengths: batches were left-padded


def test_one_drafter_copy_per_thread_runs_concurrently(target):
    """What the error advises: `copy.deepcopy(drafter)` per thread; the copies draft at once, each exactly."""
    drafter = make_drafter(target, **SETTINGS["auto+lookup+adaptation"])
    target.generate(PROMPT, do_sample=False, max_new_tokens=8, assistant_model=drafter)  # bound, with state
    copies = [copy.deepcopy(drafter) for _ in range(3)]
    prompts = [torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    expected = [target.generate(p, do_sample=False, max_new_tokens=30).tolist() for p in prompts]
    outcomes: dict[int, object] = {}

    def work(i: int) -> None:
        try:
            out = target.generate(prompts[i], do_sample=False, max_new_tokens=30, assistant_model=copies[i])
            outcomes[i] = out.tolist() == expected[i]
        except Exception as error:  # checked below
            outcomes[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert outcomes == {0: True, 1: True, 2: True}, outcomes
