"""Which admitted prompts share a prefill forward.

A prefill forward pads every prompt of its chunk to the chunk's longest, so a chunk of R prompts whose longest
has L tokens costs about one forward's fixed cost plus R * L tokens' compute. On a GPU an eager forward is bound
by launching its kernels (about 10 ms for a 1B model, whatever it is fed) while a token costs microseconds: a
forward is worth a thousand padded tokens or more, where chunks of prompts of similar lengths launch a
forward for every 10% of length. On a CPU a forward is worth a few tens.

`plan_chunks` takes the forward's worth in padded tokens (`forward_tokens`: measured on CUDA at start-up,
`cost_model.measure_prefill_cost`) and splits the prompts, longest first, into the runs that minimise
forwards * forward_tokens + padded tokens, each within `max_tokens` padded tokens: a shortest path over the
sorted lengths, O(n * rows per chunk).

    plan_chunks([300, 10, 290, 12], forward_tokens=16, max_tokens=8192) -> [[0, 2], [3, 1]]
    plan_chunks([300, 10, 290, 12], forward_tokens=1000, max_tokens=8192) -> [[0, 2, 3, 1]]
"""
from __future__ import annotations

from typing import Sequence

# A CPU forward's fixed cost in tokens: `measure_prefill_cost` gives 12-25 for the tiny models on the development
# CPU. Prefilling the 60 development prompts (esp-tiny-llama, one thread) with 0 / 4 / 16 / 64 / 256 took 2.30 /
# 2.30 / 2.37 / 2.43 / 2.52 s at batch 8 and 2.43 / 2.34 / 2.19 / 2.22 / 2.36 s at batch 32; chunks of the
# prompts within 10% of the chunk's longest took the same time as 16 at both (within 4%).
CPU_FORWARD_TOKENS = 16.0


def plan_chunks(lengths: Sequence[int], forward_tokens: float, max_tokens: int) -> list[list[int]]:
    """Indices into `lengths` per prefill forward, longest chunk first; prompts of one length keep their order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    n = len(ls)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of prefilling the j longest
    start = [0] * (n + 1)  # start[j]: where the last chunk of that plan begins
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):  # the chunk ls[i:j]: longest ls[i], padded (j - i) * ls[i]
            padded = (j - i) * ls[i]
            if j - i > 1 and padded > max_tokens:
                break  # an earlier start only adds rows and length
            cost = best[i] + forward_tokens + padded
            if cost < best[j]:
                best[j], start[j] = cost, i
    chunks, j = [], n
    while j:
        chunks.append([order[k] for k in range(start[j], j)])
        j = start[j]
    return chunks[::-1]
