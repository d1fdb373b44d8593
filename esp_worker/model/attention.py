"""Attention bias and positions for one forward over a block, shared by prefill and decode passes.

Cache layout (kv_cache.py): row b's cached slots 0 .. cache_len[b]-1 hold positions 0 .. cache_len[b]-1; the
block's Q inputs are written at slots cache_len[b] .. cache_len[b]+Q-1. A query sees every cached slot of its
row and the block slots its in-block visibility allows; stale slots (from earlier, longer blocks or other
rows' lengths) are never visible.
"""
from __future__ import annotations

from typing import Optional

import torch


def attention_bias(
    in_block: torch.Tensor,  # [B|1, Q, Q] bool: block input i may attend to block input j
    cache_len: Optional[torch.Tensor],  # [B] cached slots per row; None = empty cache (prefill)
    position_ids: torch.Tensor,  # [B, Q] positions of the block inputs
    view_len: int,  # S: key slots the model sees (>= max cache_len + Q)
    dtype: torch.dtype,
    window: Optional[int] = None,  # sliding attention window (keys at distance >= window are hidden)
    uniform_len: Optional[int] = None,  # every row has exactly this many cached slots and view_len = it + Q
    slots: Optional[torch.Tensor] = None,  # [S] arange(view_len), where the caller holds one (a replayed pass)
) -> torch.Tensor:
    """Additive bias [B, 1, Q, S]: 0 where visible, finfo.min elsewhere (eager needs finite values).

    Example: cache_len [2], Q = 2 (chain), S = 4: query 0 sees slots {0, 1, 2}, query 1 sees {0, 1, 2, 3}.
    """
    b, q = position_ids.shape
    dev = position_ids.device
    if uniform_len is not None and window is None and q > 1:  # rows of one length: [0 ... 0 | block bias]
        assert view_len == uniform_len + q
        block = torch.zeros(in_block.shape, dtype=dtype, device=dev).masked_fill_(~in_block, torch.finfo(dtype).min)
        prefix = torch.zeros((1, q, uniform_len), dtype=dtype, device=dev).expand(block.shape[0], -1, -1)
        return torch.cat([prefix, block], -1).expand(b, q, view_len)[:, None]
    if cache_len is None:  # prefill: the block is the whole view
        assert view_len == q
        hidden = ~in_block.expand(b, q, q)
        key_pos = position_ids
    else:
        slots = torch.arange(view_len, device=dev) if slots is None else slots  # [S]
        rel = slots[None] - cache_len[:, None]  # [B, S] block index of each slot; < 0 = cached prefix
        if q == 1:  # plain decoding: the prefix and the root itself (4 kernels in a replayed plain pass, its slots given)
            hidden = (rel > 0)[:, None, :]
            key_pos = slots[None].expand(b, -1)
        else:
            prefix = rel < 0
            idx = rel.clamp(0, q - 1)  # [B, S]
            visible = in_block.expand(b, q, q).gather(2, idx[:, None, :].expand(b, q, view_len))
            hidden = ~((visible & (rel < q)[:, None, :]) | prefix[:, None, :])  # [B, Q, S]
            key_pos = torch.where(prefix, slots[None], position_ids.gather(1, idx))
    if window is not None:
        hidden = hidden | ((position_ids[:, :, None] - key_pos[:, None, :]) >= window)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=dev)
    return bias.masked_fill_(hidden, torch.finfo(dtype).min)[:, None]


class StaticBlockBias:
    """`attention_bias` for a block layout that repeats (a static tree shape: its `in_block` tensor is cached and
    reused) over rows of one length: [0 ... 0 | block bias] is a right-aligned slice of a buffer built once per
    layout (grown with the context), so a pass takes a view instead of building the bias (~8 tensor ops).
    Bitwise the values `attention_bias(..., uniform_len=...)` gives."""

    MAX_ENTRIES = 16  # layouts kept (a job uses a handful: one per block size)

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}  # layout key -> [1, 1, Q, C]

    def __call__(self, key: tuple, in_block: torch.Tensor, uniform_len: int, batch: int, dtype: torch.dtype
                 ) -> torch.Tensor:
        """[B, 1, Q, S] with S = uniform_len + Q; in_block [1, Q, Q] of the static layout named `key` (the tree's
        static_key and masks per slot: one layout per key)."""
        q = in_block.shape[-1]
        view_len = uniform_len + q
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != dtype or buf.shape[-1] < view_len:
            if len(self._buffers) >= self.MAX_ENTRIES:
                self._buffers.clear()
            cap = max(256, 1 << view_len.bit_length())  # next power of two above the view
            buf = torch.zeros((1, 1, q, cap), dtype=dtype, device=in_block.device)
            buf[0, :, :, cap - q:].masked_fill_(~in_block.expand(1, q, q), torch.finfo(dtype).min)
            self._buffers[key] = buf
        bias = buf.narrow(3, buf.shape[-1] - view_len, view_len)  # [1, 1, Q, S]
        return bias if batch == 1 else bias.expand(batch, 1, q, view_len)
