"""`PagedEngine`'s KV cache groups: which layers share a block table, and what a hit needs.

A model's layers fall into groups by the kind of cache they keep (the shared design of
``docs/groups.md``): ``"full"`` attention layers keep every block, ``"sliding_window"``
layers only the blocks their window still needs (older entries of the group's table are
``None``: freed back to the group's allocator), and ``"recurrent"`` layers (linear attention,
gated delta nets) keep one state per request, plus state snapshots at every block boundary
in a pool of state blocks. Every group has the engine's one block size.

`needed` is the one place that says which blocks of a group a prefix hit at ``N`` tokens
needs, and `hit_point` the one place that picks ``N`` (the largest that every group can
serve, never the prompt's last token); an adapter can hand the per-group tables and these
ranges to kvoffload's offloader once its core has groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvoffload.errors import ConfigError

__all__ = ["EngineGroup", "GroupKind", "groups_of", "hit_point", "needed"]

GroupKind = Literal["full", "sliding_window", "recurrent"]

_LAYER_KINDS: dict[str, GroupKind] = {
    "full_attention": "full",
    "sliding_attention": "sliding_window",
    "linear_attention": "recurrent",
}


@dataclass(frozen=True, slots=True)
class EngineGroup:
    """One KV cache group of a `PagedEngine`.

    Attributes:
        name: ``"full"``, ``"sliding"`` or ``"recurrent"``.
        kind: what its layers keep.
        layers: the model's layer indices in it.
        block_size: tokens per block (for ``"recurrent"``: tokens between snapshots).
        window: the sliding window in tokens (a query at position ``p`` sees keys in
            ``(p - window, p]``), for ``"sliding_window"``.
    """

    name: str
    kind: GroupKind
    layers: tuple[int, ...]
    block_size: int
    window: int | None = None


def needed(group: EngineGroup, num_tokens: int) -> range:
    """The block indices of ``group`` that a prefix hit at ``num_tokens`` needs.

    ``num_tokens`` is a multiple of the block size. Full: every block before it; sliding
    window ``W``: the ``cdiv(W - 1, bs)`` blocks just before it; recurrent: the snapshot at
    it (block ``i`` is the state after ``(i + 1) * bs`` tokens).
    """
    bs, n = group.block_size, num_tokens // group.block_size
    if group.kind == "full":
        return range(n)
    if group.kind == "sliding_window":
        w = group.window or 1
        return range(max(0, n - -(-(w - 1) // bs)), n)
    return range(n - 1, n) if n >= 1 else range(0)


def hit_point(
    groups: Sequence[EngineGroup],
    num_prompt_tokens: int,
    has: Callable[[int, int], bool],
) -> int:
    """The largest prefix hit every group can serve: a multiple of the block size, at most
    ``num_prompt_tokens - 1`` (a recurrent state must never already include the prompt's
    last token: round down), with ``has(group_index, block_index)`` true for every block
    of `needed` in every group; 0 when there is none."""
    bs = groups[0].block_size
    n = (num_prompt_tokens - 1) // bs * bs
    while n > 0:
        if all(has(gi, i) for gi, g in enumerate(groups) for i in needed(g, n)):
            return n
        n -= bs
    return 0


def groups_of(config: Any, block_size: int) -> tuple[EngineGroup, ...]:
    """The groups of a model config: attention groups first (full, then sliding), recurrent
    last, each non-empty.

    Raises:
        ConfigError: a layer type the engine does not handle, or no attention layer.
    """
    num_layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    by_kind: dict[GroupKind, list[int]] = {"full": [], "sliding_window": [], "recurrent": []}
    for i, t in enumerate(types[:num_layers]):
        kind = _LAYER_KINDS.get(t)
        if kind is None:
            raise ConfigError(
                f"layer {i} has layer type {t!r}; the engine handles "
                f"{', '.join(sorted(_LAYER_KINDS))}"
            )
        by_kind[kind].append(i)
    if not by_kind["full"] and not by_kind["sliding_window"]:
        raise ConfigError("the model has no attention layer; the engine needs at least one")
    window = getattr(config, "sliding_window", None)
    if by_kind["sliding_window"] and not window:
        raise ConfigError("sliding-attention layers but config.sliding_window is not set")
    names = {"full": "full", "sliding_window": "sliding", "recurrent": "recurrent"}
    return tuple(
        EngineGroup(
            names[k],
            k,
            tuple(layers),
            block_size,
            int(window) if k == "sliding_window" and window else None,
        )
        for k, layers in by_kind.items()
        if layers
    )
