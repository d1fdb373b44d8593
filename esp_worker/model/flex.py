"""Decode attention as FlexAttention over a block mask (engine.attention_backend=flex, compiled replayed passes).

A replayed pass attends over its class's C key slots, masked past each row's length. SDPA takes that visibility as
a dense additive bias [B, 1, Q, C] and reads every key it covers; at batch 1 its decode kernel also spreads the
work over one thread block per key/value head, so a short pass waits on memory latency rather than bandwidth
(docs/design/cuda-graphs.md). FlexAttention takes the visibility as a function and a block mask instead: key blocks
past a row's last key are skipped, the prefix's blocks are read whole without evaluating the mask, and on CUDA its
decode kernel splits the keys across thread blocks.

What the compiled kernel needs, and why it is built this way (torch 2.13; the CPU suite compiles the same code):
- the mask function reads only tensors that are inputs of the compiled step (the rows' lengths, the in-block
  visibility): Inductor's CPU template refuses a mask over a tensor made inside the graph;
- the block mask comes from per-row block counts (`BlockMask.from_kv_blocks`), computed in the graph from the
  rows' lengths, not from `create_block_mask`, whose own kernel fails to compile on a CPU.

Flex computes the same softmax over the same visible keys as SDPA with the bias, in another order of additions:
its outputs agree with SDPA's to rounding (float32: ~2e-7 at the decode shapes), so tokens match plain decoding
as the other kernels' do (the suite checks them against `generate`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

KEY_BLOCK = 128  # key slots per block of the mask (FlexAttention's default; capacity buckets are multiples of it)


@dataclass(frozen=True)
class FlexMask:
    """Which of the C key slots each of a pass's Q inputs sees, as FlexAttention's block mask: row b's cached slots
    0 .. n_b - 1 (n_b = hist_len[b] - 1), then its block's slots n_b .. n_b + Q - 1 as the in-block visibility allows.
    The attention bias's visibility (`attention.attention_bias`, no sliding window)."""

    block_mask: BlockMask

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query [B, H, Q, hd], key and value [B, Hkv, C, hd] -> [B, Q, H, hd] (the SDPA path's layout)."""
        out = flex_attention(query, key, value, block_mask=self.block_mask, scale=scale,
                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2)


def flex_mask(hist_len: torch.Tensor, visible: torch.Tensor, num_inputs: int, capacity: int) -> FlexMask:
    """The block mask of a pass over `capacity` key slots: hist_len [B] tokens per row (its cache holds hist_len - 1
    slots), visible [L, Q, Q] in-block visibility (L = 1: one layout for every row, else one per row).

    Per row: the blocks wholly inside the prefix are full (read without the mask), the blocks from there to the
    block's last slot partial (the mask decides each key), the rest skipped. Both must be inputs of the compiled
    step (hist_len and visible are `StepInputs` fields)."""
    q, rows, per_row = num_inputs, hist_len.shape[0], visible.shape[0] > 1
    blocks = -(-capacity // KEY_BLOCK)  # key blocks of the capacity
    q_blocks = -(-q // KEY_BLOCK)
    cached = hist_len - 1  # [B]
    full = (cached // KEY_BLOCK).to(torch.int32)  # [B] prefix blocks every input sees whole
    partial = ((cached + q - 1) // KEY_BLOCK).to(torch.int32) - full + 1  # [B] blocks from there to the block's end
    ids = torch.arange(blocks, dtype=torch.int32, device=hist_len.device)  # [N]

    def counts(n: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1, Q blocks]
        return n.view(rows, 1, 1).expand(rows, 1, q_blocks).contiguous()

    def indices(first: torch.Tensor) -> torch.Tensor:  # [B] first block -> [B, 1, Q blocks, N]
        at = (ids + first.view(rows, 1, 1, 1)).clamp(max=blocks - 1)  # entries past a row's count are never read
        return at.expand(rows, 1, q_blocks, blocks).contiguous()

    def sees(b, h, qi, kv):  # FlexAttention's mask_mod: input qi of row b sees key slot kv
        rel = kv - (hist_len[b] - 1)  # < 0: the cached prefix; 0 .. Q - 1: the block
        return (rel < 0) | ((rel < q) & visible[b if per_row else 0, qi, rel.clamp(0, q - 1)])

    mask = BlockMask.from_kv_blocks(counts(partial), indices(full), counts(full), indices(torch.zeros_like(full)),
                                    BLOCK_SIZE=KEY_BLOCK, mask_mod=sees, seq_lengths=(q, capacity),
                                    compute_q_blocks=False)
    return FlexMask(mask)
