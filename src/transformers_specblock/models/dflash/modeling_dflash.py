"""DFlash drafter (block diffusion for speculative decoding; z-lab 2026, arXiv 2602.06036).

One forward over a block (the anchor = last committed token, then `block_size - 1` mask tokens; embeddings from
the TARGET's input embedding) conditioned on newly committed target context:

    c        = RMSNorm(fc(concat(h_l for l in target_layer_ids)))       # [C, L * H_target] -> [C, H]   (per context)
    for each layer (pre-norm, Qwen3-style q/k RMSNorm per head):
        q    = q_proj(RMSNorm(x))                                       # block positions only
        k, v = k_proj / v_proj of concat(c, RMSNorm(x))                 # context AND block: KV injection per layer
        x    = x + o_proj(Attention(q, [cached k; k], [cached v; v]))   # bidirectional: no causal mask anywhere
        x    = x + MLP(RMSNorm(x))
    out      = RMSNorm(x)                                               # the target's lm_head reads it

The context's keys / values stay in the drafter cache (the block's are cropped by the caller), so each committed
position is projected once. Module names follow the public checkpoints (`fc`, `hidden_norm`, `layers.*`, `norm`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from ...utils import CACHE_ARGUMENT, additive_mask
from ..tree_drafter.checkpoint_io import PublishedCheckpointMixin
from ..tree_drafter.generation_config import AUTO, DFlashGenerationConfig, TreeGenerationConfig
from ..tree_drafter.modeling_tree_drafter import TreeDraftModel, _execution_device
from .configuration_dflash import DFlashConfig, max_tree_nodes
from .convert_dflash import convert_published_dflash, detect_dflash_layout, export_dflash

__all__ = ["DFlashAttention", "DFlashDecoderLayer", "DFlashDraftModel"]


def apply_rotary_to_block(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding where the keys span [context, block] and the queries the block only (the last positions).

    query: [B, h, Q, d]; key: [B, kv, C + Q, d]; cos / sin: [B, C + Q, d]
    """
    cos, sin = cos[:, None], sin[:, None]
    q_len = query.shape[-2]
    rotated_query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
    return rotated_query, key * cos + rotate_half(key) * sin


class DFlashAttention(nn.Module):
    """Queries from the block, keys / values from [fused context; block] (appended to the cache), no causal mask."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        """hidden_states: [B, Q, H] (normed block); context: [B, C, H] (fused target context, C may be 0)."""
        batch, q_len = hidden_states.shape[:2]
        kv_states = torch.cat([context, hidden_states], dim=1)  # [B, C + Q, H]
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_states).view(batch, kv_states.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_states).view(batch, kv_states.shape[1], -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_to_block(query, key, *position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
        )  # fmt: skip
        return self.o_proj(output.reshape(batch, q_len, -1).contiguous())


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention (with the injected context) and SwiGLU MLP, each with a residual."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, past_key_values
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(PublishedCheckpointMixin, TreeDraftModel):
    """A DFlash block drafter of a frozen target (see the module docstring).

    Its `forward` is the interface transformers' `DFlashTokenCandidateGenerator` calls, so
    `target.generate(..., assistant_model=drafter, speculation_type="dflash")` runs transformers' own chain path;
    without `speculation_type` this package's tree loop drafts a best-first tree from the same forward
    (`generation.candidate_generators.dflash`). `bind_target` also keeps the target's `lm_head` (`draft_logits`).
    `from_pretrained` also reads published DFlash checkpoints (`convert_dflash`; they need `target=`), and
    `save_pretrained(folder, checkpoint_format="dflash")` writes one.
    """

    config_class = DFlashConfig
    generation_config_class = DFlashGenerationConfig
    detect_published_layout = staticmethod(detect_dflash_layout)
    convert_published = staticmethod(convert_published_dflash)
    checkpoint_writers = {"dflash": export_dflash}
    generation_defaults = {"tree_top_k": 8}  # candidates per block position
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    _unpickled_attributes = (*TreeDraftModel._unpickled_attributes, "_target_lm_head")

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        self.__dict__["_target_lm_head"] = None  # a weak reference, like the target embedding
        self.__dict__["_target_softcap"] = None
        num_features = len(config.target_layer_ids)
        self.fc = nn.Linear(num_features * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    def check_drafting_settings(self, settings: TreeGenerationConfig) -> None:
        """A tree budget (or the largest "auto" candidate) must fit in the tree one block can propose."""
        super().check_drafting_settings(settings)
        budget = settings.tree_budget
        largest = max(settings.auto_budget_candidates) if budget == AUTO else budget
        most = max_tree_nodes(self.config.block_size - 1, settings.tree_top_k)
        if largest > most:
            raise ValueError(
                f"tree budget {largest} exceeds the {most} nodes a block of {self.config.block_size} (depth "
                f"{self.config.block_size - 1}) with tree_top_k={settings.tree_top_k} can hold: raise block_size or "
                "tree_top_k, or lower the budget."
            )

    def bind_target(self, target: PreTrainedModel, place: bool = True) -> None:
        """`TreeDraftModel.bind_target`, plus the target's output embedding (`lm_head`) for `draft_logits`."""
        super().bind_target(target, place)
        self.__dict__["_target_lm_head"] = weakref.ref(target.get_output_embeddings())
        self.__dict__["_target_softcap"] = getattr(target.config.get_text_config(), "final_logit_softcapping", None)

    def target_head(self) -> tuple[torch.Tensor, float | None]:
        """The bound target's output weight [V, H] and its final logit soft-cap (Gemma), if any."""
        head = self._target_lm_head() if self._target_lm_head is not None else None
        if head is None:
            raise RuntimeError("The drafter is not bound to a target: call `drafter.bind_target(target)` first.")
        return head.weight, self._target_softcap

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, C, L * H_target] concatenated target hidden states -> [B, C, H] injected context."""
        return self.hidden_norm(self.fc(context_hidden_states.to(device=self.device, dtype=self.dtype)))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Denoise a block (the drafter cache comes as `past_key_values`, or as `cache`, the name transformers' own
        DFlash chain uses since 5.24).

        noise_embeds:          [B, Q, H]   target embeddings of [anchor, mask, ..., mask] (Q = block_size, or the
                               N * block_size blocks of a training batch)
        context_hidden_states: [B, C, L * H_target] target hidden states of the C newly committed positions
        position_ids:          [B, C + Q]  rotary positions of the context, then of the block (default: the cache
                               length onwards)
        attention_mask:        None (everything visible), a 2D [B, S] padding mask over all keys (S = cached + C + Q),
                               or a bool / additive 4D [B, 1, Q, S] mask (training: blocks see only their own
                               block and the context before their anchor)
        Returns `last_hidden_state` [B, Q, H] (after the final norm; the target's `lm_head` reads it).

        Called with `noise_embeds` of another floating dtype (transformers' chain passes the target's own
        embeddings, and feeds the output to the target's `lm_head`) it computes in its own dtype and returns the
        output in the inputs' dtype, so a drafter saved in bfloat16 serves a float32 target and stays bfloat16.
        """
        past_key_values = past_key_values if past_key_values is not None else cache
        output_dtype = noise_embeds.dtype if noise_embeds.is_floating_point() else self.dtype
        context = self.fuse_context(context_hidden_states)
        hidden_states = noise_embeds.to(device=self.device, dtype=self.dtype)
        batch, q_len = hidden_states.shape[:2]
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(past, past + context.shape[1] + q_len, device=self.device)[None]
        mask = self._attention_mask(attention_mask, q_len, hidden_states.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids.to(self.device))
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, position_embeddings, mask, past_key_values)
        hidden_states = self.norm(hidden_states).to(output_dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_ARGUMENT: past_key_values})

    @staticmethod
    def _attention_mask(attention_mask: torch.Tensor | None, q_len: int, dtype: torch.dtype) -> torch.Tensor | None:
        """None / 2D padding / 4D bool masks -> an additive [B, 1, Q, S] mask, or None when every key is visible."""
        if attention_mask is None:
            return None
        if attention_mask.dim() == 2:
            if bool(attention_mask.bool().all()):
                return None
            attention_mask = attention_mask.bool()[:, None, None, :].expand(-1, 1, q_len, -1)
        if attention_mask.dtype == torch.bool:
            return additive_mask(attention_mask, dtype)
        return attention_mask.to(dtype)

    def draft_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., H] drafter outputs -> [..., V] logits from the target's own `lm_head`."""
        self.target_head()  # raises if unbound
        head = self._target_lm_head()
        return head(hidden_states.to(device=_execution_device(head), dtype=head.weight.dtype))

    def embed_block(self, anchor_ids: torch.LongTensor) -> torch.Tensor:
        """[B] anchor tokens -> [B, block_size, H] target embeddings of [anchor, mask, ..., mask]."""
        masks = anchor_ids.new_full((anchor_ids.shape[0], self.config.block_size - 1), self.config.mask_token_id)
        return self.embed_target_tokens(torch.cat([anchor_ids[:, None], masks], dim=1))
