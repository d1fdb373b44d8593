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


def keep(cache: DynamicCache, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
    """Copy slots `src` to slots `dst` in every row, then cut every row to `length` slots.

    dst, src: [B, P] slot indices. Only the P moved slots per row are touched (P = accepted path + 1), so
    the cost of a pass does not grow with the cache or with the spread of row lengths.
    Example: rows with cache_len [3, 5] and a pass of Q=4 appended at slots 6..9. Row 0 keeps the root and
    the node at block index 2: dst [3, 4], src [6, 8]. Row 1 keeps the root only: dst [5, 6], src [6, x]
    (slot 6 of row 1 is beyond its new length 6, so whatever lands there is stale). length = 6.
    """
    b, p = src.shape
    if bool((src == dst).all()):  # nothing accepted beyond the root, already in place: just cut
        truncate(cache, length)
        return
    for layer in _layers(cache):
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [B, H, S, D]
            h, d = t.shape[1], t.shape[3]
            moved = torch.gather(t, 2, src[:, None, :, None].expand(b, h, p, d))  # [B, H, P, D]
            t.scatter_(2, dst[:, None, :, None].expand(b, h, p, d), moved)
            setattr(layer, name, t[:, :, :length])


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
