"""Recurrent layers (linear attention, gated delta nets) in `PagedEngine`'s packed steps.

A recurrent mixer carries a state from token to token, so it cannot run over a packed
sequence of several requests. `install_mixers` wraps each recurrent layer's mixer: per
request of the step it runs the stock mixer over that request's new tokens with the
request's own `RecurrentState` as its cache (split at block boundaries, so the state at
every boundary is captured as a snapshot), and concatenates the outputs.

`StatePool` is the paged pool of state snapshots: block ``b`` holds, per recurrent layer,
a conv state and a recurrent state. The engine copies a request's snapshots into it after
the step (registered in the group's allocator under the prefix hash of the boundary) and a
later request starts from one by copying it back (`StatePool.load`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, final

import torch

from kvoffload.integrations.transformers.attention import BATCH_KWARG, PagedBatch

__all__: list[str] = []

_Snapshot = dict[int, tuple[torch.Tensor, torch.Tensor]]
"""Per recurrent layer, its (conv state, recurrent state) at one boundary."""


@final
class _LayerCache:
    """One request's state in one layer, with the cache methods the stock mixer calls."""

    __slots__ = ("conv", "rec")

    def __init__(self) -> None:
        self.conv: torch.Tensor | None = None
        self.rec: torch.Tensor | None = None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.rec

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        kernel = int(kwargs.get("conv_kernel_size") or conv_states.shape[-1])
        if self.conv is None:
            full = conv_states
            if full.shape[-1] < kernel:
                full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([self.conv, conv_states], dim=-1)
        self.conv = full[..., -kernel:].clone()
        return full

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        self.rec = recurrent_states
        return recurrent_states


@final
class RecurrentState:
    """One request's recurrent state in every recurrent layer, and the snapshots its last
    step captured (block index -> per layer state)."""

    __slots__ = ("layers", "snaps")

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = {i: _LayerCache() for i in layers}
        self.snaps: dict[int, _Snapshot] = {}


def _mixer_forward(
    orig: Any, layer_idx: int, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    batch = kwargs.get(BATCH_KWARG)
    if not isinstance(batch, PagedBatch) or batch.states is None:
        raise TypeError(
            f"recurrent layer {layer_idx} needs the engine's PagedBatch in the "
            f"{BATCH_KWARG!r} keyword; run the model through the kvoffload engine"
        )
    bs = batch.snapshot_every
    outs: list[torch.Tensor] = []
    for seg, state in zip(batch.segments, batch.states, strict=True):
        if state is None:
            raise TypeError(f"recurrent layer {layer_idx}: a segment without its state")
        cache = state.layers[layer_idx]
        pos, end = seg.past, seg.past + seg.q_len
        while pos < end:
            stop = min(end, (pos // bs + 1) * bs) if bs else end
            x = hidden_states[:, seg.q_start + pos - seg.past : seg.q_start + stop - seg.past]
            outs.append(orig(x, cache=cache))
            if bs and stop % bs == 0 and cache.conv is not None and cache.rec is not None:
                snap = state.snaps.setdefault(stop // bs - 1, {})
                snap[layer_idx] = (cache.conv.clone(), cache.rec.clone())
            pos = stop
    return torch.cat(outs, dim=1)


def recurrent_mixers(model: Any, layers: Sequence[int]) -> list[torch.nn.Module]:
    """The mixer module of each recurrent layer (``linear_attn`` or ``mamba``)."""
    out = []
    for i in layers:
        layer = model.model.layers[i]
        mixer = getattr(layer, "linear_attn", None) or getattr(layer, "mamba", None)
        if mixer is None:
            raise TypeError(f"layer {i} has no recurrent mixer (linear_attn or mamba)")
        out.append(mixer)
    return out


def install_mixers(model: Any, layers: Sequence[int]) -> None:
    """Wrap each recurrent layer's mixer to run per request (once per model)."""
    for i, mixer in zip(layers, recurrent_mixers(model, layers), strict=True):
        if getattr(mixer, "_kvoffload_wrapped", False):
            continue
        mixer.forward = functools.partial(_mixer_forward, mixer.forward, i)
        object.__setattr__(mixer, "_kvoffload_wrapped", True)


def probe_states(model: Any, layers: Sequence[int], device: Any, dtype: Any) -> _Snapshot:
    """One state per recurrent layer, from running each stock mixer over one zero token
    (what the pool's rows are shaped like)."""
    hidden = int(model.config.hidden_size)
    snap: _Snapshot = {}
    with torch.inference_mode():
        for i, mixer in zip(layers, recurrent_mixers(model, layers), strict=True):
            forward = mixer.forward
            orig = forward.args[0] if isinstance(forward, functools.partial) else forward
            cache = _LayerCache()
            orig(torch.zeros((1, 1, hidden), device=device, dtype=dtype), cache=cache)
            if cache.conv is None or cache.rec is None:
                raise TypeError(f"recurrent layer {i}: the mixer kept no conv or recurrent state")
            snap[i] = (cache.conv, cache.rec)
    return snap


def _align(n: int) -> int:
    return -(-n // 8) * 8


@final
class StatePool:
    """Paged state snapshots: per recurrent layer, one byte row per state block holding a
    conv state and a recurrent state (views of the row, in the states' shapes and
    dtypes).

    Args:
        num_blocks: state blocks.
        layers: the recurrent layers.
        example: one state per layer, as `probe_states()` gives (the rows' layout).

    `rows` are the byte tensors (``uint8 [num_blocks, page_bytes]``, one per layer) a
    kvoffload offloader copies as opaque pages.
    """

    def __init__(self, num_blocks: int, layers: Sequence[int], example: _Snapshot) -> None:
        self._layers = tuple(layers)
        self._conv: dict[int, torch.Tensor] = {}
        self._rec: dict[int, torch.Tensor] = {}
        self.rows: list[torch.Tensor] = []
        """Per recurrent layer, in order, its ``uint8 [num_blocks, page_bytes]`` rows."""
        sizes = {
            i: (_align(c.numel() * c.element_size()), _align(r.numel() * r.element_size()))
            for i, (c, r) in example.items()
        }
        self.page_bytes = max(cb + rb for cb, rb in sizes.values())
        """Bytes of one layer's part of one state block."""
        for i in self._layers:
            conv, rec = example[i]
            cb = sizes[i][0]
            row = torch.zeros((num_blocks, self.page_bytes), dtype=torch.uint8, device=conv.device)
            n_conv, n_rec = conv.numel() * conv.element_size(), rec.numel() * rec.element_size()
            self._conv[i] = row[:, :n_conv].view(conv.dtype).view(num_blocks, *conv.shape)
            self._rec[i] = row[:, cb : cb + n_rec].view(rec.dtype).view(num_blocks, *rec.shape)
            self.rows.append(row)

    def store(self, block: int, snap: _Snapshot) -> None:
        """Copy one boundary's states into ``block``."""
        for i, (conv, rec) in snap.items():
            self._conv[i][block].copy_(conv)
            self._rec[i][block].copy_(rec)

    def load(self, block: int, state: RecurrentState) -> None:
        """Start ``state`` from the snapshot in ``block`` (copies: the pool stays intact)."""
        for i, cache in state.layers.items():
            cache.conv = self._conv[i][block].clone()
            cache.rec = self._rec[i][block].clone()
