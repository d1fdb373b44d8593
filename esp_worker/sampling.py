"""Token choice at one position per row: greedy, or temperature / top-k / top-p sampling by inverse CDF.

Randomness: each request owns a seeded CPU generator that fills a buffer of uniforms; exactly one uniform
is consumed per committed token, in order, whatever the method. So a seeded speculative request and the
same request decoded plainly consume the same stream and choose the same tokens.
"""
from __future__ import annotations

from typing import Optional

import torch

UNIFORM_CHUNK = 64
_GROUP = 64
_GROUPED_MIN = 98304  # elements: 24 rows of a 4096 vocabulary


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), the same index (the first maximum; NaN counts as the maximum), faster on a CPU.

    torch's CPU argmax over a vocabulary is a scalar loop (~0.9 ns per element); for large inputs the
    vocabulary is cut into groups of 64: the group maxima (a vectorised amax), the first group holding the
    maximum, then the first maximum inside it. [30, 4096] logits: ~105 -> ~38 us on one thread, [16, 4096]
    57 -> 29 us. The grouped way takes 9 more tensor ops, ~5 us each in the decode loop (where they run with
    cold caches after the model), so it is used from _GROUPED_MIN elements on. Plain argmax on other devices,
    for smaller inputs, for vocabularies that are not a multiple of 64, and in compiled code (one fused loop).
    """
    v = x.shape[-1]
    if x.device.type != "cpu" or v % _GROUP or torch.compiler.is_compiling() or x.numel() < _GROUPED_MIN:
        return x.argmax(-1)
    g = x.unflatten(-1, (v // _GROUP, _GROUP))  # [..., G, 64]
    group = g.amax(-1).argmax(-1, keepdim=True)  # [..., 1] first group holding the maximum
    inner = g.gather(-2, group.unsqueeze(-1).expand(*group.shape, _GROUP)).squeeze(-2).argmax(-1)  # [...]
    return group.squeeze(-1) * _GROUP + inner


def choose_tokens(
    logits: torch.Tensor,  # [B, V] float32
    temperature: torch.Tensor,  # [B] float, 0 = greedy
    top_p: torch.Tensor,  # [B] float in (0, 1]
    top_k: torch.Tensor,  # [B] long, 0 = off
    uniforms: Optional[torch.Tensor],  # [B] in [0, 1), None when every row is greedy
) -> torch.Tensor:
    """Returns [B] token ids."""
    greedy = argmax_last(logits)
    if uniforms is None:
        return greedy
    sampled_rows = temperature > 0
    t = torch.where(sampled_rows, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(-1)
    v = logits.shape[-1]
    rank = torch.arange(v, device=logits.device)[None]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    cum = probs.cumsum(-1)
    keep &= (cum - probs) < top_p[:, None]  # the first token is always kept
    probs = probs * keep
    cdf = probs.cumsum(-1)
    target = (uniforms * cdf[:, -1])[:, None]  # [B, 1]
    pick = torch.searchsorted(cdf, target, right=True).clamp(max=v - 1)  # [B, 1]
    sampled = sorted_idx.gather(1, pick).squeeze(1)
    return torch.where(sampled_rows, sampled, greedy)


def upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host synchronisation: on CUDA through page-locked memory and an
    asynchronous copy (a pageable copy waits for the device)."""
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


class UniformStreams:
    """Per-row buffers of uniforms drawn from per-request generators; consumption is per committed token.

    The host knows how many uniforms each row has consumed (one per generated token, `Rows.consumed`), so
    refills are decided on the host without reading the device pointer; `base[b]` is the stream index of
    buffer column 0 of row b.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.generators: list[Optional[torch.Generator]] = []
        self.base: list[int] = []  # [B] host: stream index of buffer column 0
        self.buf = torch.zeros((0, UNIFORM_CHUNK), device=device)  # [B, U]
        self.ptr = torch.zeros((0,), dtype=torch.long, device=device)  # [B] next unread column

    @staticmethod
    def generator(seed: int) -> torch.Generator:
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        return g

    def append(self, generators: list[Optional[torch.Generator]]) -> None:
        fresh = torch.stack(
            [torch.rand(UNIFORM_CHUNK, generator=g) if g is not None else torch.zeros(UNIFORM_CHUNK) for g in generators]
        )
        fresh = upload(fresh, self.device)
        self.generators.extend(generators)
        self.base.extend([0] * len(generators))
        self.buf = torch.cat([self.buf, fresh])
        self.ptr = torch.cat([self.ptr, torch.zeros(len(generators), dtype=torch.long, device=self.device)])

    def append_from(self, other: "UniformStreams") -> None:
        self.generators.extend(other.generators)
        self.base.extend(other.base)
        self.buf = torch.cat([self.buf, other.buf])
        self.ptr = torch.cat([self.ptr, other.ptr])

    def select(self, rows: torch.Tensor, keep: list[int]) -> None:
        self.generators = [self.generators[i] for i in keep]
        self.base = [self.base[i] for i in keep]
        self.buf = self.buf.index_select(0, rows)
        self.ptr = self.ptr.index_select(0, rows)

    def ensure(self, needed: int, consumed: list[int]) -> None:
        """Make sure each sampling row has at least `needed` unread uniforms (consumed: [B] host counts)."""
        for i, g in enumerate(self.generators):
            p = consumed[i] - self.base[i]  # the device pointer of row i, known on the host
            if p + needed <= UNIFORM_CHUNK:
                continue
            if g is not None:  # greedy rows in a sampling batch only need a valid pointer
                fresh = upload(torch.rand(UNIFORM_CHUNK, generator=g), self.device)
                self.buf[i] = torch.cat([self.buf[i, p:], fresh])[:UNIFORM_CHUNK]
            self.ptr[i].zero_()  # not `= 0`: a Python scalar stored by index is a host-to-device copy
            self.base[i] += p

    def take(self, active: torch.Tensor) -> torch.Tensor:
        """[B] uniforms for this step; advances the pointer of active rows only."""
        u = self.buf.gather(1, self.ptr[:, None]).squeeze(1)
        self.ptr += active.long()
        return u
