"""Published DFlash checkpoints (z-lab/dflash layout): strict loading, the architecture they describe computed
by hand from the weights, decoding, export round trip and clear errors for what does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_target
from transformers_specblock import DFlashDraftModel

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 16, 2


def published_config(target, **changes) -> dict:
    """A config.json as the public DFlash code reads it (Qwen3 config + dflash_config), for a 6-layer target."""
    text = target.config
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": text.hidden_size,
        "intermediate_size": 96, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS, "num_target_layers": text.num_hidden_layers, "vocab_size": text.vocab_size,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "rope_scaling": None, "attention_bias": False,
        "block_size": 4, "dflash_config": {"mask_token_id": 127, "target_layer_ids": [0, 2]},
        "max_window_layers": LAYERS, "use_sliding_window": False, "sliding_window": None, "tie_word_embeddings": False,
    }  # fmt: skip
    config.update(changes)
    return config


def published_weights(hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the public key names."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.15

    state = {"fc.weight": w(hidden, 2 * hidden), "hidden_norm.weight": 1 + w(hidden), "norm.weight": 1 + w(hidden)}
    shapes = {
        "self_attn.q_proj": (HEADS * HEAD_DIM, hidden), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, hidden),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, hidden), "self_attn.o_proj": (hidden, HEADS * HEAD_DIM),
        "mlp.gate_proj": (96, hidden), "mlp.up_proj": (96, hidden), "mlp.down_proj": (hidden, 96),
    }  # fmt: skip
    norms = {"self_attn.q_norm": HEAD_DIM, "self_attn.k_norm": HEAD_DIM, "input_layernorm": hidden,
             "post_attention_layernorm": hidden}  # fmt: skip
    for i in range(LAYERS):
        state |= {f"layers.{i}.{name}.weight": w(*shape) for name, shape in shapes.items()}
        state |= {f"layers.{i}.{name}.weight": 1 + w(size) for name, size in norms.items()}
    return state


def write(folder: Path, config: dict, state: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")
    return folder


def reference_block(state: dict, context: torch.Tensor, noise: torch.Tensor, eps: float, theta: float) -> torch.Tensor:
    """The DFlash forward written out from its description: fused context (fc, RMSNorm) injected as keys / values in
    every layer, per-head q / k RMSNorm, RoPE over [context; block] positions 0.., no mask, SwiGLU, final norm."""

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, positions):
        freqs = positions[:, None].float() / theta ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        cos, sin = freqs.cos().repeat(1, 2), freqs.sin().repeat(1, 2)
        half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], dim=-1)
        return x * cos + half * sin

    ctx = rms(context @ state["fc.weight"].T, state["hidden_norm.weight"])  # [C, H]
    x, c, q_len = noise, ctx.shape[0], noise.shape[0]
    positions = torch.arange(c + q_len)
    for i in range(LAYERS):
        p = lambda name: state[f"layers.{i}.{name}.weight"]  # noqa: E731
        h = rms(x, p("input_layernorm"))
        kv_in = torch.cat([ctx, h])
        q = rms((h @ p("self_attn.q_proj").T).view(q_len, HEADS, HEAD_DIM), p("self_attn.q_norm"))
        k = rms((kv_in @ p("self_attn.k_proj").T).view(c + q_len, KV_HEADS, HEAD_DIM), p("self_attn.k_norm"))
        v = (kv_in @ p("self_attn.v_proj").T).view(c + q_len, KV_HEADS, HEAD_DIM)
        q = rope(q.transpose(0, 1), positions[c:])  # [heads, Q, d]
        k = rope(k.transpose(0, 1), positions).repeat_interleave(HEADS // KV_HEADS, 0)
        v = v.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        attn = ((q @ k.transpose(1, 2)) / HEAD_DIM**0.5).softmax(-1) @ v  # [heads, Q, d]
        x = x + attn.transpose(0, 1).reshape(q_len, -1) @ p("self_attn.o_proj").T
        h = rms(x, p("post_attention_layernorm"))
        x = x + (torch.nn.functional.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    return rms(x, state["norm.weight"])


def test_published_checkpoint_loads_strictly_and_computes_dflash(tmp_path):
    target = make_target("qwen2", vocab_size=128)
    state = published_weights(target.config.hidden_size)
    folder = write(tmp_path / "pub", published_config(target), state)
    drafter = DFlashDraftModel.from_pretrained(folder, target=target, tree_budget=8)
    assert drafter.config.target_layer_ids == [0, 2] and drafter.config.feature_layers == [1, 3]
    assert (drafter.config.mask_token_id, drafter.config.block_size, drafter.config.head_dim) == (127, 4, HEAD_DIM)
    context = torch.randn(5, 2 * target.config.hidden_size)
    noise = drafter.embed_block(torch.tensor([9]))
    with torch.no_grad():
        ours = drafter(noise_embeds=noise, context_hidden_states=context[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, reference_block(state, context, noise[0], 1e-6, 50000.0), rtol=1e-4, atol=1e-4)
    prompt = torch.tensor([[0, 5, 9, 17, 3]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20)
    for speculation_type in (None, "dflash"):
        out = target.generate(prompt, do_sample=False, max_new_tokens=20, assistant_model=drafter,
                              speculation_type=speculation_type)  # fmt: skip
        assert out.tolist() == plain.tolist()
    # export writes the same layout back
    drafter.save_pretrained(tmp_path / "out", checkpoint_format="dflash")
    again = load_file(tmp_path / "out" / "model.safetensors")
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 2]}
    assert written["architectures"] == ["DFlashDraftModel"] and written["num_target_layers"] == 6


def test_public_default_layers_when_the_config_names_none(tmp_path):
    target = make_target("llama", vocab_size=128)
    config = published_config(target, dflash_config={"mask_token_id": 127})  # 2 layers over 6: [1, 3]
    drafter = DFlashDraftModel.from_pretrained(write(tmp_path, config, published_weights(64)), target=target)
    assert drafter.config.target_layer_ids == [1, 3]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c, s: s.pop("layers.1.mlp.up_proj.weight"), "key 'layers.1.mlp.up_proj.weight' is missing"),
        (lambda c, s: s.update({"layers.0.attention_conv.base_kernel": torch.zeros(2, 2, 64)}), "unexpected key"),
        (lambda c, s: s.update({"fc.weight": torch.zeros(64, 3 * 64)}), "key 'fc.weight' has shape"),
        (lambda c, s: c.update(architectures=["DFlash2DraftModel"]), "DFlash2 checkpoint"),
        (lambda c, s: c.update(layer_types=["sliding_attention"] * LAYERS, use_sliding_window=True), "sliding-window"),
        (lambda c, s: c.update(is_causal=True), "is_causal=true"),
        (lambda c, s: c.update(dflash_config={"target_layer_ids": [0, 2]}), "mask_token_id is missing"),
        (lambda c, s: c.update(num_target_layers=36), "num_target_layers=36, but the target has 6"),
        (lambda c, s: c["dflash_config"].update(final_logit_softcapping=20.0), "final_logit_softcapping=20.0"),
    ],
)
def test_published_checkpoint_errors_name_the_problem(tmp_path, change, message):
    target = make_target("llama", vocab_size=128)
    config, state = published_config(target), published_weights(64)
    change(config, state)
    with pytest.raises(ValueError, match=message):
        DFlashDraftModel.from_pretrained(write(tmp_path, config, state), target=target)


def test_published_checkpoint_needs_its_target(tmp_path):
    target = make_target("llama", vocab_size=128)
    folder = write(tmp_path, published_config(target), published_weights(64))
    with pytest.raises(ValueError, match="pass `target=<the target model>`"):
        DFlashDraftModel.from_pretrained(folder)
