"""Published checkpoint layouts in and out (issue 14): EAGLE-3 as EAGLE (SafeAILab), SpecForge / SGLang and vLLM
speculators write it, and the SpecBlock reference layout.

Each synthetic checkpoint is written here the way that tool writes it (its key names, config fields, file format),
independently of `convert_*`; the loaded drafter must hold the same weights and compute the same logits as the
drafter loaded natively, decode like plain greedy, compute what the tool's own forward computes (re-implemented below
from their published code, on THEIR key names), and survive export -> re-import bit for bit. Every malformed
checkpoint is a ValueError naming what is wrong.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from transformers_specblock import Eagle3DraftModel, SpecBlockDraftModel
from transformers_specblock.commands.convert import main as convert_main
from transformers_specblock.hub import load_packaged_model

from conftest import make_drafter, make_target

EAGLE3_LAYOUTS = ("eagle", "specforge", "speculators")
LAYOUTS = (*EAGLE3_LAYOUTS, "specblock_reference")
SMOLLM2 = dict(  # SmolLM2-135M's sizes (the packaged target `smollm2-135m-instruct`)
    vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


# ------------------------------------------------------------------------------------------------------ fixtures
def randomize(drafter, seed: int = 0, draft_vocab: int | None = None):
    """Random norm weights (so norm placement matters) and a random sorted draft vocabulary, as EAGLE builds it."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
        vocab, size = drafter.config.vocab_size, drafter.config.draft_vocab_size
        ids = torch.randperm(vocab, generator=generator)[:size].sort().values
        drafter.d2t.copy_(ids)
        drafter.t2d.zero_()
        drafter.t2d[ids] = True
    return drafter.eval()


def native_drafter(layout: str, target, **overrides):
    """A random drafter of the kind `layout` holds, with a reduced draft vocabulary."""
    overrides.setdefault("draft_vocab_size", target.config.vocab_size * 3 // 4)
    if layout == "specblock_reference":  # the reference's rank head: no biases, features within the top 20
        reference = dict(rank_head_bias=False, rank_top1_over_vocab=False, followup_positions="block1")
        drafter = make_drafter(target, **reference, **overrides)
    else:
        torch.manual_seed(7)
        drafter = Eagle3DraftModel.from_target(target, tree_budget=8, **overrides)
    return randomize(drafter)


def llama_fields(config) -> dict:
    return {
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": "silu", "rms_norm_eps": config.rms_norm_eps, "vocab_size": config.vocab_size,
        "max_position_embeddings": 2048, "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip


def write_published(folder, drafter, layout: str) -> None:
    """Write `drafter` as the tool behind `layout` writes its checkpoints (names, fields and files of that tool)."""
    os.makedirs(folder, exist_ok=True)
    config, ours = drafter.config, drafter.state_dict()
    offsets = drafter.d2t - torch.arange(config.draft_vocab_size)
    fields = llama_fields(config)
    theta = config.rope_parameters["rope_theta"]
    if layout == "specblock_reference":
        renames = {
            "condition_proj.": "input_layer.condition_proj.", "condition_norm.": "input_layer.condition_norm.",
            "token_norm.": "input_layer.token_norm.", "slot_queries.": "input_layer.position_queries.",
            "query_norm.": "input_layer.query_norm.", "fusion.": "input_layer.fuse.", "layer_shifts.": "shift_proj.",
        }  # fmt: skip
        state = {}
        for key, tensor in ours.items():
            for old, new in renames.items():
                key = new + key[len(old) :] if key.startswith(old) else key
            state[key] = tensor.clone()
        state["d2t"], state["t2d"] = offsets, drafter.t2d.clone()
        fields.update(
            architectures=["LlamaForCausalLMSpecBlock"], num_hidden_layers=config.num_hidden_layers,
            draft_vocab_size=config.draft_vocab_size, diffspec_draft_token_num=config.block_size, rank_classes=4,
            num_ttt_blocks=drafter.generation_config.max_blocks, rope_theta=theta, rope_scaling=None,
        )  # fmt: skip
        save_file(state, os.path.join(folder, "model.safetensors"))  # their save_pretrained: "embed" keys dropped
        torch.save({"d2t": offsets, "t2d": drafter.t2d.clone()}, os.path.join(folder, "vocab_mapping.pt"))
    else:
        prefix = "layers.0." if layout == "speculators" else "midlayer."
        state = {(prefix + k[len("layer.") :] if k.startswith("layer.") else k): v.clone() for k, v in ours.items()}
        state["d2t"] = offsets
        fields.update(num_hidden_layers=1, draft_vocab_size=config.draft_vocab_size)
        if config.target_hidden_size != config.hidden_size:
            fields["target_hidden_size"] = config.target_hidden_size
        ids = config.target_layer_ids
        if layout == "eagle":  # eagle/traineagle3/config.json: no head_dim, no layer ids; pytorch_model.bin
            fields.update(architectures=["LlamaForCausalLM"], head_dim=999)  # a head_dim EAGLE's code ignores
            if theta != 10000.0:
                fields["rope_theta"] = theta
            torch.save(state, os.path.join(folder, "pytorch_model.bin"))
        elif layout == "specforge":  # SGLang's output-of-layer ids; safetensors without embeddings
            fields.update(
                architectures=["LlamaForCausalLMEagle3"], head_dim=config.head_dim, rope_theta=theta,
                eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids]},
            )  # fmt: skip
            if config.fc_norm or not config.norm_output:  # newer SpecForge configs
                fields.update(fc_norm=config.fc_norm, norm_output=config.norm_output)
            save_file(state, os.path.join(folder, "model.safetensors"))
        else:  # vLLM speculators: nested decoder config, top-level input-of-layer ids, layers.0.*
            layer_config = {**fields, "head_dim": config.head_dim, "rope_theta": theta}
            for name in ("draft_vocab_size",):
                layer_config.pop(name)
            fields = {
                "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "transformer_layer_config": layer_config, "draft_vocab_size": config.draft_vocab_size,
                "norm_before_residual": config.norm_before_residual, "eagle_aux_hidden_state_layer_ids": list(ids),
                "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "target"}},
            }  # fmt: skip
            save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(fields, f)


def drafter_class(layout: str):
    return SpecBlockDraftModel if layout == "specblock_reference" else Eagle3DraftModel


def draft_logits(drafter, target, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The drafter's outputs on random target features for 6 positions (block 1 for SpecBlock, one step for EAGLE-3)."""
    generator = torch.Generator().manual_seed(seed)
    config = drafter.config
    features = torch.randn(1, 6, 3 * config.target_hidden_size, generator=generator)
    tokens = torch.randint(0, config.vocab_size, (1, 6), generator=generator)
    drafter.bind_target(target, place=False)
    with torch.no_grad():
        if isinstance(drafter, SpecBlockDraftModel):
            out = drafter(tokens, features)
            return out.logits, out.rank_logits, out.hidden_states
        positions = torch.arange(1, 7)[None]
        mask = torch.ones(6, 6, dtype=torch.bool).tril()[None]
        out = drafter.draft_step(drafter.fuse_features(features), tokens, positions, mask)
        return out.logits, out.hidden_states


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


def assert_same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


# ------------------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layout_loads_to_the_same_drafter(layout, target, tmp_path, one_thread):
    native = native_drafter(layout, target)
    write_published(tmp_path, native, layout)
    loaded = drafter_class(layout).from_pretrained(tmp_path, target=target)
    assert_same_weights(native, loaded)
    assert loaded.config.target_layer_ids == native.config.target_layer_ids
    for ours, theirs in zip(draft_logits(native, target), draft_logits(loaded, target)):
        assert torch.equal(ours, theirs)
    prompt = torch.tensor([[0, 5, 9, 17, 33, 2, 5, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20)
    with loaded.tree_settings(tree_budget=8):
        tree = target.generate(prompt, assistant_model=loaded, do_sample=False, max_new_tokens=20)
    assert torch.equal(plain, tree)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_smollm2_sized_checkpoints_load_bit_exact(layout, tmp_path, one_thread):
    target_config = LlamaConfig(**SMOLLM2)  # sizes only: loading needs no target weights
    config_cls = drafter_class(layout).config_class
    overrides = dict(draft_vocab_size=8192)
    if layout == "specblock_reference":
        overrides.update(rank_head_bias=False, rank_top1_over_vocab=False, followup_positions="block1")
    torch.manual_seed(3)
    native = randomize(drafter_class(layout)(config_cls.from_target_config(target_config, **overrides)))
    write_published(tmp_path, native, layout)
    loaded = drafter_class(layout).from_pretrained(tmp_path, target_config=target_config)
    assert_same_weights(native, loaded)
    assert loaded.config.head_dim == 64 and loaded.config.target_layer_ids == [2, 15, 27]


def test_layer_id_conventions(target, tmp_path):
    """SGLang's output-of-layer ids (+1) and vLLM's input-of-layer ids both read as HF hidden_states indices; the
    export writes both consistently; disagreeing fields are refused."""
    native = native_drafter("eagle", target, target_layer_ids=[1, 3, 4])
    native.save_pretrained(tmp_path / "out", checkpoint_format="eagle3")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]  # SGLang: output of layer
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # vLLM: input of layer = HF index
    sglang_only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}
    for fields in (sglang_only, {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}):
        config.pop("eagle_config"), config.pop("eagle_aux_hidden_state_layer_ids", None)
        config.update(fields)
        (tmp_path / "out" / "config.json").write_text(json.dumps(config))
        assert Eagle3DraftModel.from_pretrained(tmp_path / "out", target=target).config.target_layer_ids == [1, 3, 4]
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}  # = HF [2, 4, 5]: disagrees
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="name different layers"):
        Eagle3DraftModel.from_pretrained(tmp_path / "out", target=target)
    default = native_drafter("eagle", target)
    write_published(tmp_path / "eagle", default, "eagle")  # EAGLE names none: inputs of layers 2, L//2, L-3
    assert Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target).config.target_layer_ids == [2, 3, 3]


def test_a_drafter_narrower_than_its_target_uses_its_own_embedding(target, tmp_path, one_thread):
    """target_hidden_size != hidden_size (e.g. EAGLE-3 for a 70B target): the checkpoint carries an embedding of the
    drafter's width, which the loaded drafter uses; without one it cannot run and is refused."""
    narrow = dict(hidden_size=32, intermediate_size=64, own_token_embedding=True)
    native = native_drafter("eagle", target, **narrow)
    assert native.embed_tokens.weight.shape == (128, 32) and native.fc.weight.shape == (32, 192)
    write_published(tmp_path / "eagle", native, "eagle")
    loaded = Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target)
    assert loaded.config.own_token_embedding and loaded.config.target_hidden_size == 64
    assert_same_weights(native, loaded)
    generator = torch.Generator().manual_seed(3)
    features, tokens = torch.randn(1, 6, 192, generator=generator), torch.randint(0, 128, (1, 6), generator=generator)
    with torch.no_grad():
        causal = torch.ones(6, 6, dtype=torch.bool).tril()[None]
        ours = loaded.draft_step(loaded.fuse_features(features), tokens, torch.arange(1, 7)[None], causal).logits[0]
        state = read_published_state(tmp_path / "eagle")
        theirs = eagle3_reference_logits(state, loaded.config, features[0], state["embed_tokens.weight"][tokens[0]])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    loaded.save_pretrained(tmp_path / "out", checkpoint_format="eagle3")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["target_hidden_size"] == 64
    assert_same_weights(native, Eagle3DraftModel.from_pretrained(tmp_path / "out", target=target))
    rewrite_weights(tmp_path / "eagle", lambda s: s.pop("embed_tokens.weight"))
    with pytest.raises(ValueError, match="needs its own token embedding"):
        Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target)


def test_head_dim_rules(tmp_path):
    """EAGLE's code uses hidden // heads whatever the config says; SpecForge uses the config's head_dim."""
    target = make_target("llama", head_dim=32)  # 4 heads x 32 != hidden 64
    specforge = native_drafter("specforge", target)
    assert specforge.config.head_dim == 32
    write_published(tmp_path / "sf", specforge, "specforge")
    assert Eagle3DraftModel.from_pretrained(tmp_path / "sf", target=target).config.head_dim == 32
    write_published(tmp_path / "eagle", specforge, "eagle")  # EAGLE would build q_proj [4 * 16, 128]: the shapes refuse
    with pytest.raises(ValueError, match=r"'midlayer.self_attn.q_proj.weight' has shape \[128, 128\].*\[64, 128\]"):
        Eagle3DraftModel.from_pretrained(tmp_path / "eagle", target=target)


# ---------------------------------------------------------------------------- their forward, from their code
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention(x, state, prefix, config, positions, visible) -> torch.Tensor:
    """Llama attention as the published drafters write it: q/k/v, rotate-half RoPE at `positions`, GQA, softmax in
    float32 over the keys `visible` [N, N] allows, o_proj."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = (x @ state[prefix + "q_proj.weight"].T).view(-1, heads, dim).transpose(0, 1)
    k = (x @ state[prefix + "k_proj.weight"].T).view(-1, kv_heads, dim).transpose(0, 1)
    v = (x @ state[prefix + "v_proj.weight"].T).view(-1, kv_heads, dim).transpose(0, 1)
    inv_freq = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos(), angles.sin()

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., dim // 2 :], t[..., : dim // 2]], dim=-1) * sin

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    scores = (q @ k.transpose(1, 2)) / dim**0.5 + torch.where(visible, 0.0, float("-inf"))
    out = scores.softmax(-1, dtype=torch.float32) @ v
    return out.transpose(0, 1).reshape(x.shape[0], -1) @ state[prefix + "o_proj.weight"].T


def mlp(x, state, prefix) -> torch.Tensor:
    gate, up = x @ state[prefix + "gate_proj.weight"].T, x @ state[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ state[prefix + "down_proj.weight"].T


def eagle3_reference_logits(state, config, features, token_embeds) -> torch.Tensor:
    """One EAGLE-3 step over P positions (eagle/model/cnets.py LlamaDecoderLayeremb + Model; SpecForge's fc_norm and
    norm_output; vLLM's norm_before_residual), on the checkpoint's own key names."""
    eps, p = config.rms_norm_eps, ("layers.0." if "layers.0.hidden_norm.weight" in state else "midlayer.")
    if "fc_norm.0.weight" in state:
        parts = features.chunk(3, -1)
        features = torch.cat([rms(part, state[f"fc_norm.{i}.weight"], eps) for i, part in enumerate(parts)], -1)
    hidden = features @ state["fc.weight"].T
    normed = rms(hidden, state[p + "hidden_norm.weight"], eps)
    residual = normed if config.norm_before_residual else hidden
    x = torch.cat([rms(token_embeds, state[p + "input_layernorm.weight"], eps), normed], dim=-1)
    num = x.shape[0]
    positions = torch.arange(num)  # EAGLE counts drafter positions from 0; RoPE is relative
    causal = torch.ones(num, num, dtype=torch.bool).tril()
    h = residual + attention(x, state, p + "self_attn.", config, positions, causal)
    h = h + mlp(rms(h, state[p + "post_attention_layernorm.weight"], eps), state, p + "mlp.")
    return (rms(h, state["norm.weight"], eps) if config.norm_output else h) @ state["lm_head.weight"].T


def specblock_reference_outputs(state, config, features, token_embeds) -> tuple[torch.Tensor, torch.Tensor]:
    """Block 1 for P positions (specforge/modeling/draft/_llama3_specblock_base.py forward_parallel with
    llama3_specblock.py's shift), on the reference key names: (logits [P, K, Vd], rank logits [P, K, 4])."""
    eps, hidden, k_slots = config.rms_norm_eps, config.hidden_size, config.block_size
    num = features.shape[0]
    cond = rms(features @ state["input_layer.condition_proj.weight"].T, state["input_layer.condition_norm.weight"], eps)
    tok = rms(token_embeds, state["input_layer.token_norm.weight"], eps)
    query = rms(state["input_layer.position_queries.weight"], state["input_layer.query_norm.weight"], eps)
    w = state["input_layer.fuse.weight"]
    h = (cond @ w[:, :hidden].T + tok @ w[:, hidden : 2 * hidden].T)[:, None] + query @ w[:, 2 * hidden :].T
    pos, slot = torch.arange(num).repeat_interleave(k_slots), torch.arange(k_slots).repeat(num)
    visible = (pos[None] < pos[:, None]) | ((pos[None] == pos[:, None]) & (slot[None] <= slot[:, None]))
    h = h.reshape(num * k_slots, hidden)
    for i in range(config.num_hidden_layers):
        if i > 0:
            slots = h.view(num, k_slots, hidden)
            shifted = torch.cat([slots[:, :1], slots[:, :-1]], dim=1).reshape(-1, hidden)
            w = state[f"shift_proj.{i - 1}.weight"]
            h = h @ w[:, :hidden].T + shifted @ w[:, hidden:].T
        p = f"layers.{i}."
        x = rms(h, state[p + "input_layernorm.weight"], eps)
        h = h + attention(x, state, p + "self_attn.", config, pos + 1 + slot, visible)
        h = h + mlp(rms(h, state[p + "post_attention_layernorm.weight"], eps), state, p + "mlp.")
    normed = rms(h, state["norm.weight"], eps)
    logits = normed @ state["lm_head.weight"].T
    top20 = logits.topk(20, dim=-1).values.float()
    lse = top20.logsumexp(-1, keepdim=True)
    top10_lp = top20[:, :10] - lse
    gaps = top20[:, :1] - top20[:, [1, 2, 4]]
    top20_lp = top20 - lse
    entropy = -(top20_lp.exp() * top20_lp).nan_to_num(0.0).sum(-1, keepdim=True)
    features = torch.cat([top10_lp, gaps, top10_lp[:, :1].exp(), entropy], dim=-1).to(normed.dtype)
    rank = F.silu(torch.cat([normed, features], -1) @ state["rank_head.0.weight"].T) @ state["rank_head.2.weight"].T
    return logits.view(num, k_slots, -1), rank.view(num, k_slots, -1)


def read_published_state(folder) -> dict[str, torch.Tensor]:
    path = os.path.join(folder, "model.safetensors")
    return load_file(path) if os.path.exists(path) else torch.load(os.path.join(folder, "pytorch_model.bin"))


EAGLE3_VARIANTS = {  # layout -> the options that tool's checkpoints may carry
    "eagle": dict(own_token_embedding=True),  # EAGLE saved its (frozen) embedding
    "specforge": dict(fc_norm=True, norm_output=False),
    "speculators": dict(norm_before_residual=True),
}


@pytest.mark.parametrize("layout", EAGLE3_LAYOUTS)
@pytest.mark.parametrize("variant", [False, True])
def test_loaded_eagle3_computes_what_their_code_computes(layout, variant, target, tmp_path, one_thread):
    native = native_drafter(layout, target, **(EAGLE3_VARIANTS[layout] if variant else {}))
    write_published(tmp_path, native, layout)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    for option in EAGLE3_VARIANTS[layout]:
        assert getattr(loaded.config, option) == getattr(native.config, option)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 6, 3 * 64, generator=generator)
    tokens = torch.randint(0, 128, (1, 6), generator=generator)
    with torch.no_grad():
        causal = torch.ones(6, 6, dtype=torch.bool).tril()[None]
        ours = loaded.draft_step(loaded.fuse_features(features), tokens, torch.arange(1, 7)[None], causal).logits[0]
        embeds = target.get_input_embeddings()(tokens)[0]
        state = read_published_state(tmp_path)
        if "embed_tokens.weight" in state:
            embeds = state["embed_tokens.weight"][tokens[0]]
        theirs = eagle3_reference_logits(state, loaded.config, features[0], embeds)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_loaded_specblock_computes_what_the_reference_computes(target, tmp_path, one_thread):
    native = native_drafter("specblock_reference", target)
    write_published(tmp_path, native, "specblock_reference")
    loaded = SpecBlockDraftModel.from_pretrained(tmp_path, target=target)
    config = loaded.config
    assert (config.rank_head_bias, config.rank_top1_over_vocab, config.rank_feature_top_k) == (False, False, 20)
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(1, 5, 3 * 64, generator=generator)
    tokens = torch.randint(0, 128, (1, 5), generator=generator)
    with torch.no_grad():
        out = loaded(tokens, features)
        embeds = target.get_input_embeddings()(tokens)[0]
        state = read_published_state(tmp_path)
        logits, rank_logits = specblock_reference_outputs(state, loaded.config, features[0], embeds)
    torch.testing.assert_close(out.logits[0], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.rank_logits[0], rank_logits, rtol=1e-5, atol=1e-5)
    default = make_drafter(target)  # our own rank features differ from the reference's (top-1 over the vocabulary)
    assert default.config.rank_top1_over_vocab and default.rank_head[0].bias is not None
    # follow-up blocks: the reference trains and drafts them at block 1's positions, we at the start node's
    assert loaded.config.followup_positions == "block1"
    assert loaded.followup_start_positions(10, [1, 3]) == [10, 10]
    assert default.followup_start_positions(10, [1, 3]) == [11, 13]


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("fmt", ["eagle3", "specblock_reference"])
def test_export_reimport_round_trip_is_bit_exact(fmt, target, tmp_path, one_thread):
    native = native_drafter("eagle" if fmt == "eagle3" else "specblock_reference", target)
    native.save_pretrained(tmp_path / "a", checkpoint_format=fmt)
    loaded = type(native).from_pretrained(tmp_path / "a", target=target)
    assert_same_weights(native, loaded)
    for ours, theirs in zip(draft_logits(native, target), draft_logits(loaded, target)):
        assert torch.equal(ours, theirs)
    loaded.save_pretrained(tmp_path / "b", checkpoint_format=fmt)
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    first, second = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    if fmt == "eagle3":  # the engines' own loaders need it (issue 29: speculators ran on a zero embedding)
        assert torch.equal(first.pop("embed_tokens.weight"), target.get_input_embeddings().weight)
    assert not any("embed" in key for key in first)  # the reference shares the target's embedding
    if fmt == "specblock_reference":
        mapping = torch.load(tmp_path / "a" / "vocab_mapping.pt", weights_only=True)
        assert torch.equal(mapping["d2t"] + torch.arange(len(mapping["d2t"])), native.d2t)
    else:
        config = json.loads((tmp_path / "a" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "target_hidden_size" not in config
        assert set(first) >= {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}  # SpecForge's to_sglang
        assert torch.equal(first["d2t"] + torch.arange(len(first["d2t"])), native.d2t)  # offsets


@pytest.mark.parametrize("fmt", ["eagle3", "specblock_reference"])
def test_export_of_an_adapted_drafter_writes_the_loaded_weights_unless_asked(fmt, target, tmp_path):
    """As `save_pretrained` in this package's layout: online adaptation never reaches a file silently."""
    native = native_drafter("eagle" if fmt == "eagle3" else "specblock_reference", target)
    loaded_head = native.lm_head.weight.detach().clone()
    native.remember_loaded_weights()  # what the first online update does
    with torch.no_grad():
        native.lm_head.weight.add_(1.0)  # an "adapted" head
    native.save_pretrained(tmp_path / "loaded", checkpoint_format=fmt)
    native.save_pretrained(tmp_path / "adapted", checkpoint_format=fmt, save_adapted=True)
    assert torch.equal(load_file(tmp_path / "loaded" / "model.safetensors")["lm_head.weight"], loaded_head)
    assert torch.equal(load_file(tmp_path / "adapted" / "model.safetensors")["lm_head.weight"], loaded_head + 1.0)
    assert torch.equal(native.lm_head.weight, loaded_head + 1.0)  # the drafter in memory keeps its adaptation


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_checkpoint_re_exports(layout, target, tmp_path, one_thread):
    """published -> ours -> published -> ours keeps every weight."""
    native = native_drafter(layout, target)
    write_published(tmp_path / "in", native, layout)
    loaded = drafter_class(layout).from_pretrained(tmp_path / "in", target=target)
    fmt = "specblock_reference" if layout == "specblock_reference" else "eagle3"
    loaded.save_pretrained(tmp_path / "out", checkpoint_format=fmt)
    assert_same_weights(native, drafter_class(layout).from_pretrained(tmp_path / "out", target=target))


def test_export_refuses_what_the_other_tool_would_compute_differently(target, tmp_path):
    trained_here = make_drafter(target)
    with torch.no_grad():
        trained_here.rank_head[0].bias.fill_(0.1)
    with pytest.raises(ValueError, match="rank head has biases.*rank features differ"):
        trained_here.save_pretrained(tmp_path / "s", checkpoint_format="specblock_reference")
    with pytest.raises(ValueError, match="fc_norm is on"):
        native_drafter("specforge", target, fc_norm=True).save_pretrained(tmp_path / "e", checkpoint_format="eagle3")
    with pytest.raises(ValueError, match="norm_before_residual is on"):
        native = native_drafter("speculators", target, norm_before_residual=True)
        native.save_pretrained(tmp_path / "e", checkpoint_format="eagle3")
    with pytest.raises(ValueError, match="checkpoint_format='gguf' is not one Eagle3DraftModel writes"):
        native_drafter("eagle", target).save_pretrained(tmp_path / "g", checkpoint_format="gguf")
    assert not any(p.exists() for p in (tmp_path / "s", tmp_path / "e", tmp_path / "g"))


# ------------------------------------------------------------------------------------------------ malformed
class NotATensor:
    """Any object in a pickle: `torch.load(weights_only=True)` refuses it (unpickling could run code)."""


def rewrite_weights(folder, change) -> None:
    """Apply `change(state)` to a published folder's weights, in the file format it has."""
    path = os.path.join(folder, "model.safetensors")
    if os.path.exists(path):
        state = load_file(path)
        change(state)
        save_file(state, path)
    else:
        path = os.path.join(folder, "pytorch_model.bin")
        state = torch.load(path)
        change(state)
        torch.save(state, path)


def rewrite_config(folder, change) -> None:
    path = os.path.join(folder, "config.json")
    config = json.loads(open(path).read())
    change(config)
    open(path, "w").write(json.dumps(config))


MALFORMED = {  # name -> (layout, change of weights or None, change of config or None, message)
    "missing key": ("eagle", lambda s: s.pop("midlayer.mlp.down_proj.weight"), None,
                    "key 'midlayer.mlp.down_proj.weight' is missing"),
    "unexpected key": ("specforge", lambda s: s.update({"midlayer.extra.weight": torch.ones(3)}), None,
                       "unexpected key 'midlayer.extra.weight'"),
    "wrong shape": ("speculators", lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1].contiguous()}), None,
                    r"key 'fc.weight' has shape \[64, 191\].*need \[64, 192\]"),
    "reference missing shift": ("specblock_reference", lambda s: s.pop("shift_proj.0.weight"), None,
                                "key 'shift_proj.0.weight' is missing"),
    "reference rank bias": ("specblock_reference", lambda s: s.update({"rank_head.0.bias": torch.zeros(256)}), None,
                            "unexpected key 'rank_head.0.bias'"),
    "d2t absolute ids": ("specforge", lambda s: s.update({"d2t": s["d2t"] + torch.arange(96)}), None,
                         "holds absolute target ids instead"),
    "d2t outside vocabulary": ("eagle", lambda s: (s.pop("t2d", None), s.update({"d2t": s["d2t"] + 200})), None,
                               "maps draft ids outside the target vocabulary"),
    "d2t missing": ("specforge", lambda s: s.pop("d2t"), None, "key 'd2t' is missing"),
    "pickle with objects": ("eagle", lambda s: s.update({"extra": NotATensor()}), None,
                            "holds objects other than tensors"),
    "draft vocab larger than the target's": ("specforge", None, lambda c: c.update(draft_vocab_size=200),
                                             "draft_vocab_size must be in"),
    "another target": ("eagle", None, lambda c: c.update(vocab_size=256), "vocab_size is 256, the target's is 128"),
    "two layers": ("speculators", None, lambda c: c["transformer_layer_config"].update(num_hidden_layers=2),
                   "only one-layer EAGLE-3 drafters load"),
    "rope yarn": ("specforge", None, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                  "RoPE scaling 'yarn' is not supported"),
    "rank classes": ("specblock_reference", None, lambda c: c.update(rank_classes=5), "rank_classes=5"),
    "no hidden size": ("eagle", None, lambda c: c.pop("hidden_size"), "config.json has no integer 'hidden_size'"),
}  # fmt: skip


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_checkpoints_are_refused_clearly(name, target, tmp_path):
    layout, weights, config, message = MALFORMED[name]
    write_published(tmp_path, native_drafter(layout, target), layout)
    if weights is not None:
        rewrite_weights(tmp_path, weights)
    if config is not None:
        rewrite_config(tmp_path, config)
    with pytest.raises(ValueError, match=message):
        drafter_class(layout).from_pretrained(tmp_path, target=target)


def test_reference_vocab_mapping_is_read_safely_and_must_agree(target, tmp_path):
    native = native_drafter("specblock_reference", target)
    write_published(tmp_path, native, "specblock_reference")
    offsets = native.d2t - torch.arange(96)
    torch.save({"d2t": offsets.flip(0), "t2d": native.t2d.clone()}, tmp_path / "vocab_mapping.pt")
    with pytest.raises(ValueError, match="key 'd2t' differs from 'd2t' in vocab_mapping.pt"):
        SpecBlockDraftModel.from_pretrained(tmp_path, target=target)
    torch.save({"d2t": offsets, "t2d": native.t2d.clone(), "note": NotATensor()}, tmp_path / "vocab_mapping.pt")
    with pytest.raises(ValueError, match="vocab_mapping.pt is a pickle that holds objects other than tensors"):
        SpecBlockDraftModel.from_pretrained(tmp_path, target=target)
    rewrite_weights(tmp_path, lambda s: (s.pop("d2t"), s.pop("t2d")))  # the mapping file alone is enough
    torch.save({"d2t": offsets, "t2d": native.t2d.clone()}, tmp_path / "vocab_mapping.pt")
    assert torch.equal(SpecBlockDraftModel.from_pretrained(tmp_path, target=target).d2t, native.d2t)


def test_a_published_checkpoint_needs_its_target(target, tmp_path):
    write_published(tmp_path, native_drafter("eagle", target), "eagle")
    with pytest.raises(ValueError, match="pass `target=<the target model>`"):
        Eagle3DraftModel.from_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(
        tmp_path, target_config=target.config, tree_budget=4, dtype=torch.bfloat16
    )
    assert loaded.generation_config.tree_budget == 4 and loaded.dtype == torch.bfloat16  # overrides and dtype apply
    with pytest.raises(ValueError, match=r"\['low_cpu_mem_usage'\] are neither"):
        Eagle3DraftModel.from_pretrained(tmp_path, target=target, low_cpu_mem_usage=True)


@pytest.mark.parametrize("layout", ["specforge", "specblock_reference"])
def test_16_bit_checkpoints_load_in_their_dtype(layout, target, tmp_path):
    native = native_drafter(layout, target).to(torch.bfloat16)
    write_published(tmp_path, native, layout)
    loaded = drafter_class(layout).from_pretrained(tmp_path, target_config=target.config)  # dtype="auto"
    assert loaded.dtype == torch.bfloat16
    assert_same_weights(native, loaded)


def test_full_vocabulary_eagle3_without_vocab_buffers(target, tmp_path):
    """EAGLE drops d2t / t2d when the draft vocabulary is the target's: the identity map."""
    native = native_drafter("eagle", target, draft_vocab_size=128)
    write_published(tmp_path, native, "eagle")
    rewrite_weights(tmp_path, lambda s: (s.pop("d2t"), s.pop("t2d")))
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert torch.equal(loaded.d2t, torch.arange(128)) and bool(loaded.t2d.all())
    assert_same_weights(native, loaded)


# ------------------------------------------------------------------------------------------------ command
def test_specblock_convert_both_directions(target, tmp_path, capsys):
    native = native_drafter("specforge", target)
    write_published(tmp_path / "published", native, "specforge")
    target.save_pretrained(tmp_path / "target")
    assert convert_main(["--to", "native", str(tmp_path / "published"), str(tmp_path / "ours")]) == 2
    assert "--to native needs --target" in capsys.readouterr().err
    argv = ["--to", "native", "--target", str(tmp_path / "target"), str(tmp_path / "published"), str(tmp_path / "ours")]
    assert convert_main(argv) == 0
    ours = Eagle3DraftModel.from_pretrained(tmp_path / "ours")  # this package's layout: no target needed
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == "eagle3_drafter"
    assert_same_weights(native, ours)
    assert convert_main(["--to", "eagle3", str(tmp_path / "ours"), str(tmp_path / "back")]) == 2
    assert "--to eagle3 needs --target" in capsys.readouterr().err
    argv = ["--to", "eagle3", "--target", str(tmp_path / "target"), str(tmp_path / "ours"), str(tmp_path / "back")]
    assert convert_main(argv) == 0
    assert_same_weights(native, Eagle3DraftModel.from_pretrained(tmp_path / "back", target=target))
    assert convert_main(["--to", "specblock_reference", str(tmp_path / "ours"), str(tmp_path / "x")]) == 2
    assert "exports to ['eagle3', 'speculators'], not 'specblock_reference'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ real target
@pytest.mark.slow
def test_published_layouts_on_the_packaged_smollm2(tmp_path, one_thread):
    """Synthetic checkpoints at SmolLM2-135M's sizes, loaded for the real packaged target: same logits as the native
    drafter, and generate() with them equals plain greedy."""
    real, tokenizer = load_packaged_model("smollm2-135m-instruct")
    prompt = tokenizer("The three primary colours are", return_tensors="pt").input_ids
    plain = real.generate(prompt, do_sample=False, max_new_tokens=16)
    for layout in LAYOUTS:
        native = native_drafter(layout, real, draft_vocab_size=8192)
        write_published(tmp_path / layout, native, layout)
        loaded = drafter_class(layout).from_pretrained(tmp_path / layout, target=real)
        assert_same_weights(native, loaded)
        for ours, theirs in zip(draft_logits(native, real), draft_logits(loaded, real)):
            assert torch.equal(ours, theirs)
        with loaded.tree_settings(tree_budget=8):
            assert torch.equal(real.generate(prompt, assistant_model=loaded, do_sample=False, max_new_tokens=16), plain)


def test_the_shipped_drafters_export(tmp_path):
    """The shipped EAGLE-3 drafter (trained here for SmolLM2-135M) exports for SGLang / vLLM and comes back bit for
    bit; the shipped SpecBlock drafter, trained with this package's rank features, is refused by the reference export
    with the reasons."""
    shipped = Eagle3DraftModel.from_pretrained("eagle3-smollm2-135m-instruct")
    argv = ["--to", "eagle3", "--target", "smollm2-135m-instruct", "eagle3-smollm2-135m-instruct"]
    assert convert_main([*argv, str(tmp_path / "eagle3")]) == 0
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == shipped.config.target_layer_ids
    real, _ = load_packaged_model("smollm2-135m-instruct")
    back = Eagle3DraftModel.from_pretrained(tmp_path / "eagle3", target_config=real.config).state_dict()
    target_embedding = real.get_input_embeddings().weight.to(shipped.dtype)
    assert torch.equal(back.pop("embed_tokens.weight"), target_embedding)  # the export carries the target's
    assert back.keys() == shipped.state_dict().keys()
    assert all(torch.equal(tensor, back[key]) for key, tensor in shipped.state_dict().items())
    with pytest.raises(ValueError, match="cannot be exported in the reference layout: .*rank features differ"):
        SpecBlockDraftModel.from_pretrained("specblock-smollm2-135m-instruct").save_pretrained(
            tmp_path / "specblock", checkpoint_format="specblock_reference"
        )


def test_native_loading_binds_a_given_target(target, tmp_path):
    native = native_drafter("eagle", target)
    native.save_pretrained(tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(tmp_path, target=target)
    assert loaded.target_embedding is target.get_input_embeddings()
    assert_same_weights(native, loaded)


# ------------------------------------------------------------------------------------------ older native checkpoints
def test_an_older_checkpoint_with_records_in_config_json_loads_and_moves_them_out(tmp_path, caplog, recwarn):
    """Checkpoints written before config.json held the architecture only kept the run's record (`training_info`,
    with its nested `started_from` chain), the evaluation rows and training settings (EAGLE-3's `ttt_steps`) in
    config.json: they load as before (no warning about any of them), the settings are the config's, the rest is its
    training record; saved again, config.json holds the architecture only and `training_record.json` the rest, with
    no folder of the machine that wrote it."""
    import logging

    from transformers_specblock.hub.provenance import absolute_paths_in

    target = make_target("llama")
    old = tmp_path / "old"
    Eagle3DraftModel.from_target(target, tree_budget=8).save_pretrained(old)
    config = json.loads((old / "config.json").read_text())
    earlier = {"command": "specblock-train --output_dir /home/someone/runs/first", "train_tokens": 10}
    legacy = {
        "training_info": {"command": "specblock-train --init_drafter /home/someone/runs/first", "train_tokens": 20,
                          "total_train_tokens": 30, "started_from": {"drafter": "/home/someone/runs/first", **earlier}},
        "eval_results": [{"dataset": "mt_bench", "tau": 1.7, "tree_budget": 8}],
        "ttt_steps": 3, "ttt_decay": 0.7,
    }  # fmt: skip
    (old / "config.json").write_text(json.dumps({**config, **legacy}))
    (old / "training_record.json").unlink(missing_ok=True)
    caplog.set_level(logging.INFO)
    drafter = Eagle3DraftModel.from_pretrained(old)
    moved = ("training_info", "eval_results", "ttt_steps", "ttt_decay")
    said = [str(w.message) for w in recwarn] + [r.getMessage() for r in caplog.records]
    assert not [m for m in said if any(key in m for key in moved)], said
    assert (drafter.config.ttt_steps, drafter.config.ttt_decay) == (3, 0.7)  # training reads them unless told otherwise
    assert drafter.config.training_info["started_from"]["train_tokens"] == 10
    assert drafter.config.eval_results == legacy["eval_results"]
    assert not set(json.loads(drafter.config.to_json_string())) & set(moved)

    new = tmp_path / "new"
    drafter.save_pretrained(new)
    assert not set(json.loads((new / "config.json").read_text())) & set(moved)
    record = json.loads((new / "training_record.json").read_text())
    assert record["training_settings"] == {"ttt_steps": 3, "ttt_decay": 0.7}
    assert record["evaluation"] == legacy["eval_results"] and record["training"]["total_train_tokens"] == 30
    assert record["training"]["started_from"]["drafter"] == "<local>:runs/first"
    assert absolute_paths_in(record) == [] and "/home/" not in (new / "training_record.json").read_text()
    again = Eagle3DraftModel.from_pretrained(new)  # the new layout round-trips
    assert again.config.training_record == {k: v for k, v in record.items() if k != "about"}
    assert (again.config.ttt_steps, again.config.ttt_decay) == (3, 0.7) and again.config.eval_results[0]["tau"] == 1.7
    # a drafter that has no record writes no record file
    plain = tmp_path / "plain"
    Eagle3DraftModel.from_target(target, tree_budget=8).save_pretrained(plain)
    assert not (plain / "training_record.json").exists()
