"""A drafter follows its target: generate drafts with `served_for(target)`, the drafter itself or a copy on the device
of the target's input embedding in the target's dtype (the user's drafter is never cast or moved);
`bind_target(place=True)` places the drafter itself; both refuse clearly (weights on the meta device). CPU only here,
so a second dtype and the meta device stand in for a second device."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY, make_drafter, make_target
from transformers_specblock import Eagle3DraftModel, SpecBlockDraftModel
from transformers_specblock.models.tree_drafter.modeling_tree_drafter import _execution_device

VOCAB = 24
PROMPT = torch.tensor([[0, 5, 9, 3, 7, 2, 5, 9]])

pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, **kwargs):
    return model.generate(PROMPT, max_new_tokens=12, do_sample=False, **kwargs)


def floating_dtypes(model) -> set[torch.dtype]:
    return {t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}


@pytest.mark.parametrize("kind", ["specblock", "eagle3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # float16 runs on the CPU in torch >= 2.x
def test_float32_drafter_follows_a_16bit_target(kind, dtype):
    target = make_target("llama", vocab_size=VOCAB, seed=2, attn="eager").to(dtype)
    torch.manual_seed(5)
    if kind == "specblock":
        low = make_drafter(target, tree_budget=16)
    else:
        low = Eagle3DraftModel.from_target(target, tree_top_k=3, tree_depth=3, tree_budget=16)
    wide = copy.deepcopy(low).float()  # the same weights in float32 (exact), as a float32 checkpoint would load
    assert low.dtype == dtype and wide.dtype == torch.float32

    expected = greedy(target)
    assert torch.equal(greedy(target, assistant_model=low), expected)
    assert torch.equal(greedy(target, assistant_model=wide), expected)
    served = wide.served_for(target)
    assert floating_dtypes(wide) == {torch.float32} and floating_dtypes(served) == {dtype}  # it drafted in the
    for (name, a), (_, b) in zip(low.state_dict().items(), served.state_dict().items()):  # target's dtype ...
        assert torch.equal(a, b), name  # ... with exactly the 16-bit drafter's weights (d2t / t2d untouched)
    assert served.d2t.dtype == torch.long and served.t2d.dtype == torch.bool
    # so it drafts the same trees as the 16-bit drafter
    assert wide.last_stats.nodes_per_iteration == low.last_stats.nodes_per_iteration
    assert wide.last_stats.accepted_per_iteration == low.last_stats.accepted_per_iteration


def test_16bit_drafter_follows_a_float32_target():
    target = make_target("llama", vocab_size=VOCAB, seed=2)
    drafter = make_drafter(target).to(torch.bfloat16)  # e.g. a shipped bf16 drafter with a float32 CPU target
    out = greedy(target, assistant_model=drafter)
    assert torch.equal(out, greedy(target)) and floating_dtypes(drafter) == {torch.bfloat16}  # left as it was
    assert floating_dtypes(drafter.served_for(target)) == {torch.float32}


def test_sampling_with_a_drafter_of_another_dtype():
    target = make_target("llama", vocab_size=VOCAB, seed=2, attn="eager").to(torch.bfloat16)
    drafter = make_drafter(target).float()
    torch.manual_seed(0)
    out = target.generate(PROMPT, max_new_tokens=10, do_sample=True, assistant_model=drafter)
    assert out.shape == (1, PROMPT.shape[1] + 10) and drafter.dtype == torch.float32  # drafted by a bfloat16 copy


def test_drafter_on_the_meta_device_is_refused():
    target = make_target("llama", vocab_size=VOCAB)
    config = make_drafter(target).config
    with torch.device("meta"):
        empty = SpecBlockDraftModel(config).eval()
    with pytest.raises(ValueError, match="weights are on the meta device.*load them first"):
        empty.bind_target(target)
    with pytest.raises(ValueError, match="weights are on the meta device"):
        greedy(target, assistant_model=empty)


def test_target_on_the_meta_device_is_refused():
    with torch.device("meta"):
        target = LlamaForCausalLM(LlamaConfig(**TINY, vocab_size=VOCAB))
    drafter = make_drafter(make_target("llama", vocab_size=VOCAB))
    with pytest.raises(ValueError, match="target's input embedding is on the meta device"):
        drafter.bind_target(target)
    assert drafter.device.type == "cpu"  # left where it was


def test_place_false_binds_without_moving_or_casting():
    target = make_target("llama", vocab_size=VOCAB).to(torch.bfloat16)
    drafter = make_drafter(target).float()
    drafter.bind_target(target, place=False)  # what training does: its Trainer owns placement and float32 weights
    assert floating_dtypes(drafter) == {torch.float32}
    assert drafter.target_embedding is target.get_input_embeddings()
    tokens = drafter.embed_target_tokens(PROMPT)
    assert tokens.dtype == torch.float32 and torch.equal(tokens, target.get_input_embeddings()(PROMPT).float())


def test_execution_device_of_an_offloaded_embedding():
    """Under a device_map with offloaded weights the embedding's weight sits on the meta device and accelerate's hook
    names where it runs: the drafter goes there."""
    embedding = torch.nn.Embedding(4, 2, device="meta")
    embedding._hf_hook = SimpleNamespace(execution_device="cpu")
    assert _execution_device(embedding) == torch.device("cpu")
    embedding._hf_hook = SimpleNamespace(hooks=[SimpleNamespace(), SimpleNamespace(execution_device=0)])
    assert _execution_device(embedding) == torch.device("cuda", 0)  # accelerate names GPUs by index
    assert _execution_device(torch.nn.Embedding(4, 2)) == torch.device("cpu")  # no hook: the weight's device


# ------------------------------------------------------------------------------------------------ training
def test_init_drafter_keeps_its_float32_weights_with_a_16bit_target(tmp_path):
    """Training binds with place=False: a float32 --init_drafter is not rounded through the target's bfloat16."""
    from transformers_specblock.training import ModelArguments
    from transformers_specblock.training.run import _build_drafter

    target = make_target("llama", vocab_size=VOCAB)
    saved = make_drafter(target)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(1e-3 * torch.randn_like(p))  # values bfloat16 cannot hold
    saved.save_pretrained(tmp_path / "init")
    args = ModelArguments(target_model="tiny", init_drafter=str(tmp_path / "init"), init_head_from_target=False)
    built = _build_drafter(args, target.to(torch.bfloat16), None)
    assert floating_dtypes(built) == {torch.float32}
    for name, value in saved.state_dict().items():
        assert torch.equal(built.state_dict()[name], value), name


def test_training_with_a_bfloat16_target(tmp_path):
    from test_training import common_args, make_tokenizer, write_conversations
    from transformers_specblock.commands.cli import parse_train_args
    from transformers_specblock.training import run_training

    make_target("llama", vocab_size=128).save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    ws = {"target": str(tmp_path / "target"), "data": str(write_conversations(tmp_path / "chats.jsonl", 8))}
    argv = common_args(ws, tmp_path / "out", "--max_steps", "2", "--dtype", "bfloat16", "--device", "cpu")
    trainer = run_training(*parse_train_args(argv))
    assert trainer.target.dtype == torch.bfloat16 and trainer.target.device.type == "cpu"
    assert floating_dtypes(trainer.model) == {torch.float32}  # the drafter trains in float32 weights
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
