"""The only code that touches the Hugging Face cache object.

Layout: every layer holds keys/values [B, H, S, D]. Row b's valid slots are 0 .. cache_len[b]-1, packed to
the front in position order (slot s holds position s); slots >= cache_len[b] are stale and masked out.
A decode pass appends Q slots per row; `keep` then packs root + accepted nodes behind each row's prefix.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    return DynamicCache()


def _layers(cache: DynamicCache) -> list[Any]:
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.numel()]


def seq_len(cache: DynamicCache) -> int:
    layers = _layers(cache)
    return layers[0].keys.shape[-2] if layers else 0


def keep(cache: DynamicCache, start: int, src: torch.Tensor) -> None:
    """Rewrite slots [start, start + L) of every row from source slots `src` and drop everything after.

    src: [B, L] slot indices (>= start) into the current cache. Slots before `start` are not touched, so a
    pass costs a gather over the tail only (about Q + max spread of row lengths), not the whole cache.
    Example: rows with cache_len [5, 7], a pass of Q=4 appended at slots 7..10; row 0 keeps the root and one
    node (block idx 0, 2) -> src row 0 = [7, 9, ...]; row 1 keeps [5, 6, 7] (its prefix + root).
    """
    b, length = src.shape
    for layer in _layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, H, S, D]
            h, d = t.shape[1], t.shape[3]
            idx = src[:, None, :, None].expand(b, h, length, d)
            gathered = torch.gather(t, 2, idx)  # [B, H, L, D]
            t[:, :, start : start + length] = gathered
            setattr(layer, name, t[:, :, : start + length])


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` ([R] long), in that order."""
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, rows)
        layer.values = layer.values.index_select(0, rows)


def _pad_seq(t: torch.Tensor, length: int) -> torch.Tensor:
    if t.shape[2] == length:
        return t
    pad = t.new_zeros((t.shape[0], t.shape[1], length - t.shape[2], t.shape[3]))
    return torch.cat([t, pad], dim=2)


def append_rows(cache: DynamicCache, other: DynamicCache) -> DynamicCache:
    """Rows of `other` appended after the rows of `cache` (seq dims padded with stale slots)."""
    a, b = _layers(cache), _layers(other)
    if not a:
        return other
    length = max(seq_len(cache), seq_len(other))
    for la, lb in zip(a, b):
        la.keys = torch.cat([_pad_seq(la.keys, length), _pad_seq(lb.keys, length)], dim=0)
        la.values = torch.cat([_pad_seq(la.values, length), _pad_seq(lb.values, length)], dim=0)
    return cache


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop slots >= length in every row."""
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def nbytes(cache: DynamicCache) -> int:
    return sum(l.keys.numel() * l.keys.element_size() * 2 for l in _layers(cache))
