"""SpecBlock drafter: one forward drafts a block of K mutually dependent future tokens per position."""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from ...utils import CACHE_ARGUMENT, additive_mask, to_device
from ..tree_drafter.checkpoint_io import PublishedCheckpointMixin
from ..tree_drafter.generation_config import SpecBlockGenerationConfig, TreeGenerationConfig
from ..tree_drafter.modeling_tree_drafter import TreeDraftModel
from .configuration_specblock import SpecBlockConfig
from .convert_specblock import (
    convert_published_specblock,
    detect_specblock_layout,
    export_specblock_reference,
    reference_drafting_settings,
)

NUM_RANK_FEATURES = 15


def block_causal_mask(num_positions: int, block_size: int, past_length: int, device: torch.device) -> torch.BoolTensor:
    """[P*K, past+P*K] visibility for feeding P new positions of K slots each to the drafter.

    Slot k of position p sees every cached entry, all K slots of earlier new positions and slots 0..k of its own.
    """
    pos = torch.arange(num_positions, device=device).repeat_interleave(block_size)
    slot = torch.arange(block_size, device=device).repeat(num_positions)
    new = (pos[None, :] < pos[:, None]) | ((pos[None, :] == pos[:, None]) & (slot[None, :] <= slot[:, None]))
    past = torch.ones(num_positions * block_size, past_length, dtype=torch.bool, device=device)
    return torch.cat([past, new], dim=1)


def host_block_causal_mask(num_positions: int, block_size: int, past_length: int) -> numpy.ndarray:
    """`block_causal_mask` built on the host (numpy bool), for decoding: one copy to the device instead of a dozen
    small ops. Position p's K slots see every earlier position's slots and, among its own, slots 0..k."""
    earlier = numpy.tril(numpy.ones((num_positions, num_positions), dtype=bool), -1)
    own = numpy.tril(numpy.ones((block_size, block_size), dtype=bool))
    new = numpy.kron(earlier, numpy.ones((block_size, block_size), dtype=bool)) | numpy.kron(
        numpy.eye(num_positions, dtype=bool), own
    )
    return numpy.concatenate([numpy.ones((new.shape[0], past_length), dtype=bool), new], axis=1)


def followup_block_mask(
    inherited: numpy.ndarray, block_size: int, prefix_length: int, device: torch.device | str
) -> torch.BoolTensor:
    """[1, B*K, prefix + T + B*K] visibility for B follow-up blocks drafted in one batch (a batch of one sequence).

    inherited: [B, T] bool, which of the T drafting-time cache entries (block 1's and earlier rounds' slots) each
    block sees. Every block also sees the committed prefix and slots 0..k of itself, never another new block.
    Built on the host (where drafting chooses the blocks): one copy to `device`.
    """
    num_blocks, num_inherited = inherited.shape
    rows = num_blocks * block_size
    mask = numpy.zeros((rows, prefix_length + num_inherited + rows), dtype=bool)
    mask[:, :prefix_length] = True
    mask[:, prefix_length : prefix_length + num_inherited] = inherited.repeat(block_size, axis=0)
    own = host_block_causal_mask(1, block_size, 0)  # [K, K]: slots 0..k of the block itself
    mask[:, prefix_length + num_inherited :] = numpy.kron(numpy.eye(num_blocks, dtype=bool), own)
    return to_device(mask[None], device)


@dataclass
class SpecBlockOutput(ModelOutput):
    """Drafter outputs for P positions x K slots.

    logits:        [B, P, K, draft_vocab]
    hidden_states: [B, P, K, H] pre-norm slot states (the condition a follow-up block inherits)
    rank_logits:   [B, P, K, num_rank_classes]
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    rank_logits: torch.Tensor | None = None
    past_key_values: Cache | None = None


def rank_features(logits: torch.Tensor, top_k: int = 20, top1_over_vocab: bool = True) -> torch.Tensor:
    """[..., V] draft logits -> [..., 15] rank-head features, in this order:

    top-10 log-probs within the top-`top_k`, gaps logit1-logit2/3/5, top-1 probability (over the whole draft
    vocabulary, or within the top-`top_k` when not `top1_over_vocab`, as the SpecBlock reference), top-`top_k` entropy.
    """
    logits = logits.float()
    k = min(top_k, logits.shape[-1])
    top = logits.topk(k, dim=-1).values
    if k < top_k:  # tiny vocabularies: pad with clearly-worse logits
        top = torch.cat([top, top[..., -1:].expand(*top.shape[:-1], top_k - k) - 30.0], dim=-1)
    top_logp = top.log_softmax(-1)
    gaps = top[..., :1] - top[..., [1, 2, 4]]
    top1_logp = top[..., 0] - logits.logsumexp(-1) if top1_over_vocab else top_logp[..., 0]
    top1_prob = top1_logp.exp().unsqueeze(-1)
    entropy = -(top_logp.exp() * top_logp).sum(-1, keepdim=True)
    return torch.cat([top_logp[..., :10], gaps, top1_prob, entropy], dim=-1)


class SpecBlockPreTrainedModel(PublishedCheckpointMixin, TreeDraftModel):
    config_class = SpecBlockConfig
    generation_config_class = SpecBlockGenerationConfig
    # the SpecBlock reference layout in and out: see `convert_specblock`
    detect_published_layout = staticmethod(detect_specblock_layout)
    convert_published = staticmethod(convert_published_specblock)
    published_drafting_settings = staticmethod(reference_drafting_settings)
    checkpoint_writers = {"specblock_reference": export_specblock_reference}
    config: SpecBlockConfig
    base_model_prefix = "specblock"
    supports_gradient_checkpointing = False
    _no_split_modules = ["LlamaDecoderLayer"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, SpecBlockDraftModel):
            hidden = self.config.hidden_size
            for shift in module.layer_shifts:  # start as "keep h_k": identity on the own-slot half
                init.copy_(shift.weight, torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
            if self.config.fusion_identity_init:  # the condition passes straight through the fusion
                weight = module.fusion.weight
                init.copy_(weight, torch.cat([torch.eye(hidden, dtype=weight.dtype), weight[:, hidden:]], dim=1))


class SpecBlockDraftModel(SpecBlockPreTrainedModel):
    """The SpecBlock drafter.

    Per (position i, slot k): fusion(condition_i, token_i, query_k) -> Llama decoder layers with a layer-wise slot
    shift -> final norm -> `lm_head` over the draft vocabulary, plus a rank head predicting how far down the draft
    distribution the target's token lies. Slot k of position i sits at rotary position `position_ids[i] + k`.

    The token path reads the TARGET's input embedding, bound with `bind_target` and never saved with the drafter.
    """

    tree_constructions = ("package", "reference")  # "reference": `specblock_reference_tree`

    def check_drafting_settings(self, settings: TreeGenerationConfig) -> None:
        """One branch width per rank class, every width within the draft vocabulary; the reference harness's context
        feeding is not online-adapted (its replayed context is not the package's)."""
        super().check_drafting_settings(settings)
        classes, vocab = self.config.num_rank_classes, self.config.draft_vocab_size
        if len(settings.branch_widths) != classes or max(settings.branch_widths) > vocab:
            raise ValueError(
                f"branch_widths needs one width in [0, draft_vocab_size={vocab}] per rank class of this drafter "
                f"({classes}), got {settings.branch_widths}."
            )
        if settings.fixed_width > vocab:
            raise ValueError(f"fixed_width must lie in [1, draft_vocab_size={vocab}], got {settings.fixed_width}.")
        if settings.context_feeding == "reference" and settings.online_adaptation != "off":
            raise ValueError('context_feeding="reference" drafts without online adaptation: set online_adaptation="off".')

    def __init__(self, config: SpecBlockConfig) -> None:
        super().__init__(config)
        hidden, target_hidden = config.hidden_size, config.target_hidden_size
        self.condition_proj = nn.Linear(3 * target_hidden, hidden, bias=False)
        self.condition_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.token_norm = LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps)
        self.slot_queries = nn.Embedding(config.block_size, hidden)
        self.query_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        # fusion(concat(condition [H], token [H_target], query [H])) -> H
        self.fusion = nn.Linear(2 * hidden + target_hidden, hidden, bias=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # h_k <- W_l [h_k ; h_{k-1}] before every layer l > 0
        self.layer_shifts = nn.ModuleList(
            nn.Linear(2 * hidden, hidden, bias=False) for _ in range(config.num_hidden_layers - 1)
        )
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rank_head = nn.Sequential(
            nn.Linear(hidden + NUM_RANK_FEATURES, config.rank_head_hidden_size, bias=config.rank_head_bias),
            nn.SiLU(),
            nn.Linear(config.rank_head_hidden_size, config.num_rank_classes, bias=config.rank_head_bias),
        )
        self.post_init()

    # ----------------------------------------------------------------------------------------------------------
    # Drafting
    # ----------------------------------------------------------------------------------------------------------
    def project_condition(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., 3 * H_target] concatenated target features -> [..., H] block condition (pre-norm)."""
        return self.condition_proj(target_hidden_states.to(device=self.device, dtype=self.dtype))

    def draft_blocks(
        self,
        condition: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.BoolTensor,
        past_key_values: Cache | None = None,
        logits_to_keep: int = 0,
        compute_heads: bool = True,
        num_slots: int | None = None,
    ) -> SpecBlockOutput:
        """Draft one block of K slots for each of P positions.

        condition:      [B, P, H]  projected target features or an inherited slot state (pre-norm)
        input_ids:      [B, P]     the token at each position (target vocabulary)
        position_ids:   [B, P]     rotary position of that token; slot k uses position + k
        attention_mask: [B, P*K, S] bool visibility over (cached + new) entries, S = cached + P*K
        logits_to_keep: compute `logits` / `rank_logits` for the last this many positions only (0 = all): reading a
                        prompt needs the last position's block alone, and the draft `lm_head` dominates its cost
        compute_heads:  False = return the slot states only (training runs `heads` on the slots its loss reads)
        num_slots:      draft only slots 0..num_slots-1 of each block (default all K; `attention_mask` then has
                        P*num_slots rows): a slot sees only the slots before it, so theirs are unchanged
        """
        batch, num_pos = input_ids.shape
        k_slots, hidden = num_slots or self.config.block_size, self.config.hidden_size
        target_hidden = self.config.target_hidden_size
        cond = self.condition_norm(condition)  # [B, P, H]
        tok = self.token_norm(self.embed_target_tokens(input_ids))  # [B, P, H_t]
        # fusion(concat(cond, tok, query)) computed as W_ct [cond; tok] + W_q query: one matmul per position.
        w_ct = self.fusion.weight[:, : hidden + target_hidden]
        per_position = F.linear(torch.cat([cond, tok], dim=-1), w_ct)  # [B, P, H]
        h = (per_position[:, :, None, :] + self.slot_inputs(k_slots)).reshape(batch, num_pos * k_slots, hidden)

        slot_positions = position_ids[:, :, None] + torch.arange(k_slots, device=position_ids.device)
        slot_positions = slot_positions.reshape(batch, num_pos * k_slots)
        position_embeddings = self.rotary_emb(h, slot_positions)
        mask = additive_mask(attention_mask, h.dtype)[:, None]  # [B, 1, P*K, S]

        for layer_idx, layer in enumerate(self.layers):
            if layer_idx > 0:
                slots = h.view(batch, num_pos, k_slots, hidden)
                previous = torch.cat([slots[:, :, :1], slots[:, :, :-1]], dim=2)  # slot 0 pairs with itself
                h = self.layer_shifts[layer_idx - 1](torch.cat([slots, previous], dim=-1))
                h = h.view(batch, num_pos * k_slots, hidden)
            h = layer(
                h,
                attention_mask=mask,
                position_ids=slot_positions,
                use_cache=past_key_values is not None,
                **{CACHE_ARGUMENT: past_key_values},
                position_embeddings=position_embeddings,
            )

        hidden_states = h.view(batch, num_pos, k_slots, hidden)
        if not compute_heads:
            return SpecBlockOutput(hidden_states=hidden_states, past_key_values=past_key_values)
        logits, rank_logits = self.heads(hidden_states[:, -logits_to_keep:])
        return SpecBlockOutput(
            logits=logits, hidden_states=hidden_states, rank_logits=rank_logits, past_key_values=past_key_values
        )

    def slot_inputs(self, num_slots: int) -> torch.Tensor:
        """[K, H] each slot's share of the fusion, `W_q query_norm(query_k)`, for slots 0..num_slots-1.

        A function of the weights alone: without gradients it is kept between forwards (a norm and a matmul fewer per
        drafter forward) and computed afresh once one of its weights changed (training, online adaptation, `to`)."""
        weights = (self.slot_queries.weight, self.query_norm.weight, self.fusion.weight)
        keep = not torch.is_grad_enabled() and not any(w.is_inference() for w in weights)
        key = (num_slots, *((w.data_ptr(), w._version, w.dtype) for w in weights)) if keep else None
        kept = self.__dict__.get("_slot_inputs")
        if kept is not None and kept[0] == key:
            return kept[1]
        w_q = self.fusion.weight[:, self.config.hidden_size + self.config.target_hidden_size :]
        inputs = F.linear(self.query_norm(self.slot_queries.weight[:num_slots]), w_q)  # [K, H]
        if keep:
            self.__dict__["_slot_inputs"] = (key, inputs)
        return inputs

    def followup_start_positions(self, root_position: int, start_depths: list[int]) -> list[int]:
        """Rotary position of each follow-up block's start token (slot k sits k further) for start nodes at
        `start_depths` below a root at `root_position`: root + depth ("start_node"), or the root's, i.e. block 1's
        positions ("block1", the SpecBlock reference's rule in training and drafting)."""
        if self.config.followup_positions == "block1":
            return [root_position] * len(start_depths)
        return [root_position + depth for depth in start_depths]

    def heads(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm slot states [..., H] -> (draft logits [..., Vd], rank logits [..., num_rank_classes])."""
        normed = self.norm(hidden_states)
        logits = self.lm_head(normed)
        config = self.config
        features = rank_features(logits.detach(), config.rank_feature_top_k, config.rank_top1_over_vocab)
        features = features.to(normed.dtype)
        return logits, self.rank_head(torch.cat([normed.detach(), features], dim=-1))

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.BoolTensor | None = None,
        past_key_values: Cache | None = None,
    ) -> SpecBlockOutput:
        """Draft block 1 for every position of a sequence (teacher-forced on the target's features).

        input_ids:            [B, T] token x_{i+1} at position i
        target_hidden_states: [B, T, 3 * H_target] target features of position i
        position_ids:         [B, T] rotary position of x_{i+1} (default: 1..T)
        """
        batch, length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(1, length + 1, device=input_ids.device).expand(batch, -1)
        if attention_mask is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            attention_mask = block_causal_mask(length, self.config.block_size, past, input_ids.device)[None]
            attention_mask = attention_mask.expand(batch, -1, -1)
        return self.draft_blocks(
            self.project_condition(target_hidden_states), input_ids, position_ids, attention_mask, past_key_values
        )

