"""``sparse_sdpa``: exact SDPA that skips the keys a chunk of queries cannot see, for the SpecBlock training pass.

A SpecBlock training block attends over P*K slot queries with an explicit mask: block 1's (slot k of position i
sees every slot of earlier positions and its own slots 0..k) hides half of the keys, a follow-up block's (block 1's
slots up to its position, its own slots at its position) three quarters of twice as many. SDPA kernels given an
explicit mask still compute every masked score. Here the queries are cut into chunks of `QUERY_CHUNK`; each chunk
runs transformers' own SDPA over only the key columns one of its queries sees. A dropped column is one every
query of the chunk masks (additive dtype-min or False), whose softmax weight is exactly 0, so the output equals
full SDPA up to float summation order. Registered in transformers' `AttentionInterface` under `SPARSE_SDPA`.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

SPARSE_SDPA = "sparse_sdpa"
QUERY_CHUNK = 256


def _visible(attention_mask: torch.Tensor) -> torch.BoolTensor:
    """[B, heads, Q, S] bool or additive mask -> [Q, S]: visible to some batch row and head."""
    if attention_mask.dtype == torch.bool:
        visible = attention_mask
    else:
        visible = attention_mask > torch.finfo(attention_mask.dtype).min
    return visible.flatten(0, -3).any(0)


def sparse_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA per chunk of queries over the keys that chunk sees; same signature and output."""
    num_queries = query.shape[2]
    if attention_mask is None or num_queries <= QUERY_CHUNK:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    visible = _visible(attention_mask)
    outputs = []
    for start in range(0, num_queries, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, num_queries)
        columns = visible[start:end].any(0).nonzero().squeeze(-1)
        mask = attention_mask[:, :, start:end].index_select(-1, columns)
        out, _ = sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key.index_select(2, columns),
            value.index_select(2, columns),
            mask,
            dropout,
            scaling,
            **kwargs,
        )
        outputs.append(out)
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(SPARSE_SDPA, sparse_sdpa_attention_forward)
