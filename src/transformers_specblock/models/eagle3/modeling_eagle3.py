"""EAGLE-3 drafter (Li et al. 2025, arXiv 2503.01840), the in-package baseline SpecBlock is measured against.

Architecture (one drafter position i: target features f_i, token x_{i+1} at rotary position i+1, predicts x_{i+2}):

    hidden_i = fc(concat(f_low, f_mid, f_high))                        # 3 * H_target -> H
    a_i      = concat(RMSNorm(E_target[x_{i+1}]), RMSNorm(hidden_i))   # H_target + H (= 2H)
    h_i      = hidden_i + o_proj(Attention(q/k/v_proj(a_i)))           # one Llama-style layer, q/k/v read 2H
    h_i      = h_i + MLP(RMSNorm(h_i))
    logits_i = lm_head(RMSNorm(h_i))                                   # over the draft vocabulary (d2t / t2d)

`h_i` (pre-norm) is the drafter's own H-dim output: at deeper tree depths (and in later training-time-test steps) it
replaces the fused target feature as the `hidden` input of the next position. `E_target` is the frozen target input
embedding, bound with `bind_target` and never saved with the drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)
from transformers.utils import ModelOutput

from ...utils import CACHE_ARGUMENT, additive_mask
from ..tree_drafter.checkpoint_io import PublishedCheckpointMixin
from ..tree_drafter.generation_config import Eagle3GenerationConfig
from ..tree_drafter.modeling_tree_drafter import TreeDraftModel
from .configuration_eagle3 import Eagle3Config
from .convert_eagle3 import convert_published_eagle3, detect_eagle3_layout, export_eagle3, export_speculators

__all__ = [
    "Eagle3Attention",
    "Eagle3Config",
    "Eagle3DecoderLayer",
    "Eagle3DraftModel",
    "Eagle3Output",
]


@dataclass
class Eagle3Output(ModelOutput):
    """Drafter outputs for P positions.

    loss:         the training-time-test loss `sum_s ttt_decay**s * step_losses[s]` (when labels were given)
    logits:       [B, P, draft_vocab] step-0 logits (teacher-forced on the target features)
    hidden_states:[B, P, H] step-0 pre-norm outputs (the `hidden` input of the next depth / step)
    step_losses:  [ttt_steps] mean soft cross-entropy of every unroll step
    all_logits:   per unroll step, [B, P, draft_vocab] (only with `return_all_steps=True`)
    stats:        detached metric sums in the layout of `training_stat_names(ttt_steps)` (one slot per unroll step)
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    past_key_values: Cache | None = None
    step_losses: torch.Tensor | None = None
    all_logits: tuple[torch.Tensor, ...] | None = None
    stats: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------------
class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v projections read the 2H input concat(token embedding, hidden).

    `forward` is Llama's (rotary, KV cache, `ALL_ATTENTION_FUNCTIONS` / `eager_attention_forward` with an additive
    4D mask); `ttt_forward` is the training-time-test attention (see `Eagle3DraftModel.forward`).
    """

    def __init__(self, config: Eagle3Config, layer_idx: int = 0) -> None:
        super().__init__(config, layer_idx)
        in_features = config.token_embedding_size + config.hidden_size
        bias = config.attention_bias
        self.q_proj = nn.Linear(in_features, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_features, config.num_key_value_heads * self.head_dim, bias=bias)

    def ttt_forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        causal_mask: torch.Tensor,
        step_kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Attention of unroll step s = len(step_kv) over P positions (appends this step's keys / values to step_kv).

        Query i of step s sees the step-0 keys of positions 0..i (`causal_mask`, additive [P, P]) and the keys of
        steps 1..s at position i only (the "diagonal"): exactly the entries a depth-s tree node sees at inference
        (the committed context, then one ancestor per depth). Computed as P x P scores plus s diagonal scores, so a
        step costs one causal attention, not (s+1) x P keys per query.
        """
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, h, P, d]
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # [B, kv, P, d]
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        step_kv.append((key, value))

        groups = self.num_key_value_groups
        key0, value0 = repeat_kv(step_kv[0][0], groups), repeat_kv(step_kv[0][1], groups)
        scores = [torch.matmul(query, key0.transpose(2, 3)) * self.scaling + causal_mask]  # [B, h, P, P]
        later = [(repeat_kv(k, groups), repeat_kv(v, groups)) for k, v in step_kv[1:]]
        for k, _ in later:
            scores.append((query * k).sum(-1, keepdim=True) * self.scaling)  # [B, h, P, 1]
        weights = nn.functional.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(query.dtype)
        weights = nn.functional.dropout(weights, p=self.attention_dropout, training=self.training)
        num_pos = query.shape[2]
        out = torch.matmul(weights[..., :num_pos], value0)
        for j, (_, v) in enumerate(later):
            out = out + weights[..., num_pos + j : num_pos + j + 1] * v
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out)


class Eagle3DecoderLayer(nn.Module):
    """EAGLE-3's single decoder layer: attention over concat(RMSNorm(token embedding), RMSNorm(hidden)), residual on
    the (un-normed) hidden, then a Llama SwiGLU MLP block."""

    def __init__(self, config: Eagle3Config, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(config.token_embedding_size, eps=config.rms_norm_eps)  # token embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, layer_idx)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self,
        token_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        ttt_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """token_embeds [B, P, H_target], hidden [B, P, H] -> pre-norm output [B, P, H].

        With `ttt_kv` (a list of earlier unroll steps' keys / values) the training-time-test attention runs and
        `attention_mask` is the additive [P, P] causal mask of step 0; otherwise `attention_mask` is an additive
        [B, 1, P, S] mask over (cached + new) entries and `past_key_values` is updated.
        """
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.norm_before_residual else hidden
        attn_input = torch.cat([self.input_layernorm(token_embeds), normed_hidden], dim=-1)
        if ttt_kv is not None:
            attn_out = self.self_attn.ttt_forward(attn_input, position_embeddings, attention_mask, ttt_kv)
        else:
            attn_out, _ = self.self_attn(
                attn_input,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                **{CACHE_ARGUMENT: past_key_values},
            )
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# ---------------------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------------------
class Eagle3PreTrainedModel(PublishedCheckpointMixin, TreeDraftModel):
    config_class = Eagle3Config
    generation_config_class = Eagle3GenerationConfig
    # published EAGLE-3 layouts (EAGLE, SpecForge / SGLang, vLLM speculators) in and out: see `convert_eagle3`
    detect_published_layout = staticmethod(detect_eagle3_layout)
    convert_published = staticmethod(convert_published_eagle3)
    checkpoint_writers = {"eagle3": export_eagle3, "speculators": export_speculators}
    generation_defaults = {"tree_budget": 59}  # EAGLE's total_tokens - 1
    config: Eagle3Config
    base_model_prefix = "eagle3"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Eagle3DecoderLayer"]


class Eagle3DraftModel(Eagle3PreTrainedModel):
    """The EAGLE-3 drafter: `fc` feature fusion, one decoder layer, final norm, `lm_head` over the draft vocabulary.

    `generate(assistant_model=drafter)` drafts dynamic top-k trees (`generation.candidate_generators.eagle3`); `forward` with target
    labels returns the training-time-test loss.
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        # SpecForge's optional per-feature RMSNorm before `fc`
        self.fc_norm = (
            nn.ModuleList(LlamaRMSNorm(config.target_hidden_size, eps=config.rms_norm_eps) for _ in range(3))
            if config.fc_norm
            else None
        )
        # a published checkpoint's own token embedding (frozen, as EAGLE trains it); else the target's is read
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if config.own_token_embedding else None
        if self.embed_tokens is not None:
            self.embed_tokens.weight.requires_grad_(False)
        self.layer = Eagle3DecoderLayer(config, 0)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.post_init()

    # ----------------------------------------------------------------------------------------------------------
    # Drafting
    # ----------------------------------------------------------------------------------------------------------
    def fuse_features(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """[..., 3 * H_target] concatenated target features -> [..., H] fused hidden (`fc`)."""
        features = target_hidden_states.to(device=self.device, dtype=self.dtype)
        if self.fc_norm is not None:
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, features.chunk(3, dim=-1))], dim=-1)
        return self.fc(features)

    def embed_target_tokens(self, input_ids: torch.LongTensor) -> torch.Tensor:
        """Token embeddings: the drafter's own `embed_tokens` when it has one, else the target's."""
        if self.embed_tokens is None:
            return super().embed_target_tokens(input_ids)
        return self.embed_tokens(input_ids.to(self.device))

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm outputs -> [..., draft_vocab] logits (`lm_head(norm(h))`, or `lm_head(h)` without
        `norm_output`)."""
        return self.lm_head(self.norm(hidden) if self.config.norm_output else hidden)

    def draft_step(
        self,
        hidden: torch.Tensor,
        input_ids: torch.LongTensor,
        position_ids: torch.LongTensor,
        attention_mask: torch.BoolTensor,
        past_key_values: Cache | None = None,
        logits_to_keep: int = 0,
    ) -> Eagle3Output:
        """One drafter forward over P positions (appends their K/V to `past_key_values`).

        hidden:         [B, P, H]  fused target features, or the drafter's own output of the producing position
        input_ids:      [B, P]     the token at each position (target vocabulary)
        position_ids:   [B, P]     rotary position of that token
        attention_mask: [B, P, S]  bool visibility over (cached + new) entries, S = cached + P
        logits_to_keep: compute `logits` for the last this many positions only (0 = all)
        """
        token_embeds = self.embed_target_tokens(input_ids)
        hidden = hidden.to(self.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        mask = additive_mask(attention_mask.to(hidden.device), hidden.dtype)[:, None]  # [B, 1, P, S]
        out = self.layer(token_embeds, hidden, position_embeddings, mask, past_key_values)
        logits = self.output_logits(out[:, -logits_to_keep:])
        return Eagle3Output(logits=logits, hidden_states=out, past_key_values=past_key_values)

    # ----------------------------------------------------------------------------------------------------------
    # Training-time test
    # ----------------------------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor,
        features: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        target_logits: torch.Tensor | None = None,
        target_argmax: torch.LongTensor | None = None,
        ttt_steps: int | None = None,
        return_all_steps: bool = False,
        followup_offsets: Sequence[int] | None = None,
    ) -> Eagle3Output:
        """Training-time test (TTT): the drafter unrolled `ttt_steps` steps on its own outputs over a sequence.

        input_ids [B, T] (right-padded); features [B, T, 3 * H_target] target features per position;
        attention_mask / loss_mask [B, T] (1 = real token / token the drafter is trained to predict; default all);
        target_logits [B, T, Vd] (or [B, T, V]: the draft columns `d2t` are taken) the target's logits at every
        position; target_argmax [B, T] the target's greedy token over the FULL vocabulary (default: the argmax of
        `target_logits`, i.e. always inside the draft vocabulary). `followup_offsets` is accepted and ignored (so a
        SpecBlock-style trainer can call this unchanged). Without `target_logits` no loss is computed and, unless
        `ttt_steps` is given, only step 0 runs.

        Unroll, in the drafter's slot view (slot i = 0..T-2, whose chain starts from the real features f_i):

        * step 0: hidden f'_i = fc(f_i), token x_{i+1}, rotary position i+1, predicts x_{i+2}.
        * step s > 0: hidden = the drafter's step-(s-1) output h^{s-1}_i (pre-norm), token x_{i+1+s} (ground truth),
          rotary position i+1+s, predicts x_{i+2+s}. In sequence order (position p = i+s) this is: "the hidden input
          at position p is the previous step's output at position p-1".
        * attention: step s of slot i attends to the step-0 keys of slots 0..i (causal: the real context up to the
          chain's start) and to the keys of steps 1..s of slot i itself (the chain drafted so far), never to
          another slot's later-step keys. This is exactly what a depth-s tree node sees at inference (the committed
          cache, then its ancestors), and the standard EAGLE-3 TTT rule.

        Loss: step s of slot i is compared with the target's distribution at position j = i+1+s (the distribution
        of x_{j+1}), restricted to the draft vocabulary and renormalised (softmax of the draft-vocab logits):
        ``ce = -sum_v p(v) log q(v)``. It counts where x_{j+1} exists, is real and is in `loss_mask`, and the
        target's argmax at j lies inside the draft vocabulary (no valid-prefix masking: a step counts whether or not
        the earlier steps were right). ``step_losses[s] = sum(ce * counted) / max(1, sum(counted))`` over the batch
        and ``loss = sum_s ttt_decay**s * step_losses[s]``.
        """
        batch, length = input_ids.shape
        num_pos = length - 1
        device = input_ids.device
        if num_pos < 1:
            raise ValueError("Training sequences need at least 2 tokens.")
        steps = ttt_steps if ttt_steps is not None else (self.config.ttt_steps if target_logits is not None else 1)
        if steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {steps}.")
        real = attention_mask.bool() if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        counted_tokens = (loss_mask.bool() if loss_mask is not None else torch.ones_like(real)) & real

        token_embeds = self.embed_target_tokens(input_ids)  # [B, T, H_t]
        slots = torch.arange(num_pos, device=device)
        causal = additive_mask(slots[None, :] <= slots[:, None], self.dtype)  # [P, P]
        hidden = self.fuse_features(features[:, :num_pos])
        ttt_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        all_hidden = []
        for s in range(steps):
            token_idx = (slots + 1 + s).clamp(max=length - 1)  # slots past the end run on a clamped token
            positions = (slots + 1 + s)[None].expand(batch, -1)
            position_embeddings = self.rotary_emb(hidden, positions)
            hidden = self.layer(token_embeds[:, token_idx], hidden, position_embeddings, causal, ttt_kv=ttt_kv)
            all_hidden.append(hidden)

        # with a loss the head runs only on the slots it reads (below); the dense logits only when asked for
        dense = target_logits is None or return_all_steps
        all_logits = [self.output_logits(h) for h in all_hidden] if dense else [None] * steps
        output = Eagle3Output(
            logits=all_logits[0],
            hidden_states=all_hidden[0],
            all_logits=tuple(all_logits) if return_all_steps else None,
        )
        if target_logits is None:
            return output

        if target_logits.shape[-1] != self.config.draft_vocab_size:
            if target_logits.shape[-1] != self.config.vocab_size:
                raise ValueError(
                    f"target_logits must cover the draft vocabulary ({self.config.draft_vocab_size}) or the full "
                    f"vocabulary ({self.config.vocab_size}), got {target_logits.shape[-1]} columns."
                )
            target_logits = target_logits.index_select(-1, self.d2t.to(target_logits.device))
        target_probs = target_logits.to(device).float().softmax(-1)
        if target_argmax is None:
            target_index = target_probs.argmax(-1)
        else:
            lookup = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device)
            lookup[self.d2t.to(device)] = torch.arange(self.config.draft_vocab_size, device=device)
            target_index = lookup[target_argmax.to(device)]

        # step s of slot i compares with target position j = i+1+s and predicts token j+1 (past the end: no flag)
        def step_view(values: torch.Tensor, start: int, fill: int | bool) -> torch.Tensor:
            view = values[:, start : start + num_pos]  # [B, P]: slot i reads values[:, start + i]
            return nn.functional.pad(view, (0, num_pos - view.shape[1]), value=fill)

        ce_cols, mask_cols, correct_cols, counted_cols, exists_cols = [], [], [], [], []
        alive = None  # rows of the logged chain whose steps so far were all right
        for s, step_hidden in enumerate(all_hidden):
            tid = step_view(target_index[:, : length - 1], 1 + s, -1)
            counted = step_view(counted_tokens, 2 + s, False)
            exists = step_view(real, 2 + s, False)
            mask = counted & (tid >= 0)
            if alive is None:
                alive = counted & step_view(real, 2 + steps - 1, False)  # chain rows: slot counted, chain inside
            # the loss and its per-step counts read `mask`; the chain also reads correctness on its live rows
            rows = mask.nonzero(as_tuple=True)
            logits = self.output_logits(step_hidden[rows])
            log_q = logits.float().log_softmax(-1)
            ce = torch.zeros(batch, num_pos, device=device).index_put(
                rows, -(target_probs[rows[0], rows[1] + 1 + s] * log_q).sum(-1)
            )
            correct = torch.zeros_like(mask)
            correct[rows] = log_q.detach().argmax(-1) == tid[rows]
            chain_rows = (alive & (tid >= 0) & ~mask).nonzero(as_tuple=True)
            if chain_rows[0].numel():
                with torch.no_grad():
                    correct[chain_rows] = self.output_logits(step_hidden[chain_rows]).argmax(-1) == tid[chain_rows]
            alive = alive & correct
            ce_cols.append(ce)
            mask_cols.append(mask)
            correct_cols.append(correct)
            counted_cols.append(counted)
            exists_cols.append(exists)
        ce, mask = torch.stack(ce_cols, -1), torch.stack(mask_cols, -1)  # [B, P, steps]
        correct, counted, exists = (torch.stack(c, -1) for c in (correct_cols, counted_cols, exists_cols))

        step_losses = (ce * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)
        weights = torch.tensor([self.config.ttt_decay**s for s in range(steps)], device=device)
        loss = (weights * step_losses).sum()

        with torch.no_grad():  # metric sums in the SpecBlock trainer's layout (one "slot" per unroll step)
            chain = correct.long().cumprod(-1)
            accept_rows = counted[..., 0] & exists[..., -1]
            zero = torch.zeros((), dtype=torch.double, device=device)
            stats = torch.cat(
                [
                    torch.stack([loss.detach().double(), zero]),
                    torch.tensor([1.0, float(real.sum())], dtype=torch.double, device=device),
                    (correct & counted).sum((0, 1)).double(),
                    counted.sum((0, 1)).double(),
                    (ce.detach() * mask).sum((0, 1)).double(),
                    mask.sum((0, 1)).double(),
                    torch.stack([((1 + chain.sum(-1)) * accept_rows).sum(), accept_rows.sum()]).double(),
                    torch.stack([zero, zero]),
                ]
            )
        output.loss = loss
        output.step_losses = step_losses
        output.stats = stats
        return output
