"""Paged attention for ``transformers`` models: the glue between block tables and the model.

The engine runs every request of a step as one packed sequence (batch size 1, the
requests' new tokens one after another, each with its own positions). Registered with
``transformers.AttentionInterface`` under `ATTENTION_NAME`, `paged_attention` is called by
every attention layer with the step's new queries, keys and values (rotary embeddings
already applied). For each layer it

1. writes the new keys and values into the request's blocks of the paged KV cache, at the
   slots the step's `PagedBatch` names, and
2. attends, per request, over the keys and values of all its tokens so far: freshly
   computed, loaded from the CPU pool, or taken from the engine's GPU prefix cache.

Keys are stored after rotary encoding, at the positions they were computed for. A block is
only ever reused at the same positions (a prefix hit is a prefix), so encoded keys are
exactly what a recompute would produce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION_NAME", "PagedBatch", "Segment", "paged_attention"]

ATTENTION_NAME = "kvoffload_paged"
"""The name under which `paged_attention` is registered with ``transformers``."""

BATCH_KWARG = "kvoffload_batch"
"""The keyword the engine passes the step's `PagedBatch` to the model under."""


@dataclass(slots=True)
class Segment:
    """One request's part of a packed step.

    Attributes:
        q_start: index of its first new token in the packed sequence.
        q_len: its new tokens.
        past: tokens of it whose KV was already in the cache before this step.
        blocks: per attention group, the block ids that hold tokens
            ``[first * block_size, past + q_len)``.
        first: per attention group, the index of the first block in ``blocks`` (0 for
            full attention; a sliding-window group starts at the first block its window
            needs: the blocks before it may be freed).
    """

    q_start: int
    q_len: int
    past: int
    blocks: Sequence[torch.Tensor]
    first: Sequence[int] = (0,)


@dataclass(slots=True)
class PagedBatch:
    """What one step's attention needs besides the model's own tensors.

    Attributes:
        kv: per layer, the ``blocks_first`` cache tensor
            ``[num_blocks, 2, block_size, kv_heads, head_dim]`` (``None`` for a
            recurrent layer).
        segments: the requests, in packed order.
        slot_blocks: per attention group, for every packed token, the block its KV goes to.
        slot_offsets: for every packed token, its slot in that block.
        layer_group: per layer, the index of its attention group (-1: recurrent).
        windows: per attention group, its sliding window or ``None``.
        states: per segment, the request's recurrent state (``None`` without recurrent
            layers).
        snapshot_every: tokens between recurrent state snapshots (0: none).
    """

    kv: Sequence[torch.Tensor | None]
    segments: list[Segment]
    slot_blocks: Sequence[torch.Tensor]
    slot_offsets: torch.Tensor
    layer_group: Sequence[int] = ()
    windows: Sequence[int | None] = (None,)
    states: Sequence[Any] | None = None
    snapshot_every: int = 0


def _causal_mask(q_len: int, past: int, start: int = 0, window: int | None = None) -> torch.Tensor:
    """``[q_len, past + q_len - start]``: query ``i`` (position ``past + i``) sees the keys at
    positions ``start ..`` up to its own, and only those in ``(past + i - window, past + i]``
    with a window."""
    rows = torch.arange(q_len)[:, None] + past
    cols = torch.arange(start, past + q_len)[None, :]
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def paged_attention(  # noqa: PLR0917 - the signature transformers calls
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Write the step's keys and values into the paged cache and attend per request.

    Args:
        module: the attention layer (its ``layer_idx`` picks the cache tensor).
        query: ``[1, heads, tokens, head_dim]``.
        key: ``[1, kv_heads, tokens, head_dim]``, rotary-encoded.
        value: ``[1, kv_heads, tokens, head_dim]``.
        attention_mask: ignored (the segments define the masking).
        scaling: the softmax scale.
        dropout: must be 0 (inference only).
        kwargs: must hold the step's `PagedBatch` under `BATCH_KWARG`.

    Returns:
        ``([1, tokens, heads, head_dim], None)``, the layout ``transformers`` expects.

    Raises:
        TypeError: called without a `PagedBatch` (the model was run outside the engine).
        RuntimeError: called with a batch size other than 1.
    """
    batch = kwargs.get(BATCH_KWARG)
    if not isinstance(batch, PagedBatch):
        raise TypeError(
            f"attention implementation {ATTENTION_NAME!r} needs the engine's PagedBatch in "
            f"the {BATCH_KWARG!r} keyword; run the model through the kvoffload engine"
        )
    if query.shape[0] != 1:
        raise RuntimeError(f"paged attention packs requests into batch size 1, got {query.shape}")
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    cache = batch.kv[layer_idx]
    if cache is None:
        raise RuntimeError(f"layer {layer_idx} is not an attention layer of the engine")
    gi = batch.layer_group[layer_idx] if batch.layer_group else 0
    window = batch.windows[gi]
    slots = batch.slot_blocks[gi]
    k_new = key[0].transpose(0, 1)  # [tokens, kv_heads, head_dim]
    v_new = value[0].transpose(0, 1)
    cache[slots, 0, batch.slot_offsets] = k_new.to(cache.dtype)
    cache[slots, 1, batch.slot_offsets] = v_new.to(cache.dtype)
    heads, head_dim = query.shape[1], query.shape[3]
    bs = cache.shape[2]
    out = query.new_empty((1, query.shape[2], heads, head_dim))
    for seg in batch.segments:
        q = query[:, :, seg.q_start : seg.q_start + seg.q_len]
        if window is not None:
            start = seg.first[gi] * bs
            ctx = seg.past + seg.q_len - start
            blocks = cache[seg.blocks[gi]]
            kv_heads = blocks.shape[3]
            k = blocks[:, 0].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
            v = blocks[:, 1].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
            mask: torch.Tensor | None = _causal_mask(seg.q_len, seg.past, start, window)
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling, enable_gqa=True
            )
        elif seg.past == 0:
            k = key[:, :, seg.q_start : seg.q_start + seg.q_len]
            v = value[:, :, seg.q_start : seg.q_start + seg.q_len]
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=seg.q_len > 1, scale=scaling, enable_gqa=True
            )
        else:
            ctx = seg.past + seg.q_len
            blocks = cache[seg.blocks[gi]]  # [n, 2, block_size, kv_heads, head_dim]
            kv_heads = blocks.shape[3]
            k = blocks[:, 0].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
            v = blocks[:, 1].reshape(-1, kv_heads, head_dim)[:ctx].transpose(0, 1)[None]
            mask = None
            if seg.q_len > 1:
                mask = _causal_mask(seg.q_len, seg.past)
            o = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scaling, enable_gqa=True
            )
        out[0, seg.q_start : seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    return out, None
