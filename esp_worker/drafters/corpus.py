"""The job's n-grams: continuations from the requests a job has already finished (hybrid's "corpus" proposer).

A large offline job generates from many prompts of a kind (the same template, the same code base, the same
style); what earlier requests said (their prompts and outputs) predicts what a later one will say where its
own history has no match. The store keeps the latest `capacity` tokens of finished requests in a ring buffer
(`tokens` [G], -1 = separator / empty) and, per n-gram length n, a hash table from an n-gram to the stamp
(absolute write offset) just past its latest occurrence (`table` [N, H]). Lookups are tensor ops over the
rows (no host read); insertion happens when a request finishes, between passes, once per request.

Lookup (`continuation`): for n from max_ngram down to min_ngram, hash the row's last n tokens (root included),
read the table, check that the buffer still holds exactly those n tokens there (hash collisions and
overwritten slots fail the check), and take the longest n that matches; the draft is the (up to) `depth`
tokens that followed it, stopping at the end of that request.

Example: finished request [5 6 7 8]; a row ending in [.. 9 5 6] with no earlier [5 6] of its own gets the chain
[7 8] (n = 2).

Drafts only steer speed: verification keeps the output exactly plain decoding's whatever the store holds.
The store lives for one `Engine.generate_iter` call (a job, or one shard of it on an actor).
"""
from __future__ import annotations

import torch

PRIME = 2_147_483_647  # 2^31 - 1: hash values stay below it, products below 2^52 (exact in int64)
MULT = 1_000_003


class CorpusNgrams:
    """Ring buffer of finished requests' tokens + per-length n-gram hash tables (see the module docstring)."""

    def __init__(self, capacity: int, max_ngram: int, min_ngram: int, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError("the corpus needs a capacity >= 1 token")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("corpus n-gram lengths need 1 <= min_ngram <= max_ngram")
        self.capacity = capacity
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_buckets = 1 << max(10, (2 * capacity - 1).bit_length())  # >= 2 buckets per token
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new job)."""
        if getattr(self, "written", 1) == 0:
            return  # already empty
        n = self.max_ngram - self.min_ngram + 1
        self.tokens = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)  # [G]
        self.table = torch.full((n, self.num_buckets), -1, dtype=torch.long, device=self.device)  # [N, H] stamps
        self.written = 0  # host: stamp of the next write (tokens written so far, separators included)
        self.empty = True

    def to(self, device: torch.device) -> "CorpusNgrams":
        if torch.device(device) != self.device:
            self.device = torch.device(device)
            self.tokens, self.table = self.tokens.to(device), self.table.to(device)
        return self

    # ---- hashing -----------------------------------------------------------------------------------
    def _suffix_hashes(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., max_ngram] (oldest first) -> [..., N] hash of the last n tokens, n = max_ngram .. min_ngram.

        Folded from the newest token backwards, so the hash of n + 1 tokens extends the hash of n."""
        h = torch.zeros(windows.shape[:-1], dtype=torch.long, device=windows.device)
        out = {}
        for n in range(1, self.max_ngram + 1):
            h = (h * MULT + windows[..., -n] + 1) % PRIME
            if n >= self.min_ngram:
                out[n] = h
        return torch.stack([out[n] for n in range(self.max_ngram, self.min_ngram - 1, -1)], -1)

    def _slots(self, hashes: torch.Tensor) -> torch.Tensor:
        """[..., N] hashes -> [..., N] flat indices into table (row = n-gram length)."""
        rows = torch.arange(hashes.shape[-1], device=hashes.device) * self.num_buckets
        return rows + hashes % self.num_buckets

    # ---- insertion (host side, once per finished request) ------------------------------------------
    def add(self, ids: list[int]) -> None:
        """Append one finished request's tokens (prompt + output) and index its n-grams."""
        g = self.capacity
        ids = ids[-(g - 1):] if len(ids) >= g else ids
        if len(ids) < 1:
            return
        start = self.written % g
        if start + len(ids) + 1 > g:  # a request never wraps: start over at the buffer's beginning
            self.written += g - start
            start = 0
        x = torch.tensor(list(ids) + [-1], dtype=torch.long, device=self.device)  # [L + 1] separator last
        self.tokens[start: start + len(x)] = x
        m = self.max_ngram
        if len(ids) >= self.min_ngram:
            padded = torch.cat([torch.full((m - 1,), -2, dtype=torch.long, device=self.device), x[:-1]])
            windows = padded.unfold(0, m, 1)  # [L, m]: the m tokens ending at each position (-2 = before start)
            hashes = self._suffix_hashes(windows)  # [L, N]
            lengths = torch.arange(self.max_ngram, self.min_ngram - 1, -1, device=self.device)  # [N]
            ends = torch.arange(1, len(ids) + 1, device=self.device)  # [L] exclusive end offset in the request
            fits = ends[:, None] >= lengths[None]  # [L, N] the n-gram lies inside the request
            stamps = (self.written + ends)[:, None].expand_as(hashes)
            self.table.view(-1).scatter_reduce_(0, self._slots(hashes)[fits], stamps[fits], reduce="amax")
        self.written += len(x)
        self.empty = False

    # ---- lookup (tensor ops, no host read) ----------------------------------------------------------
    def continuation(self, hist: torch.Tensor, length: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, depth] tokens, [B, depth] valid, prefix-closed) following the longest match of each row's suffix."""
        b, c = hist.shape
        dev, m, g = hist.device, self.max_ngram, self.capacity
        steps = torch.arange(m, device=dev)
        idx = length[:, None] - m + steps  # [B, m] the row's last m tokens
        suffix = torch.where(idx >= 0, hist.gather(1, idx.clamp(0, c - 1)), -2)
        stamp = self.table.view(-1)[self._slots(self._suffix_hashes(suffix))]  # [B, N]
        lengths = torch.arange(self.max_ngram, self.min_ngram - 1, -1, device=dev)  # [N]
        end = stamp % g  # [B, N] buffer offset just past the n-gram
        # the buffer must still hold the n-gram there: compare the last n of m tokens
        back = end[..., None] - m + steps  # [B, N, m]
        held = self.tokens[back % g]
        used = steps[None, None] >= (m - lengths)[None, :, None]  # [1, N, m] positions inside the n-gram
        same = ((held == suffix[:, None, :]) | ~used).all(-1) & (back >= 0).where(used, True).all(-1)
        ok_n = same & (stamp >= 0) & (stamp > self.written - g) & (length[:, None] >= lengths[None])  # [B, N]
        first = ok_n.long().argmax(-1)  # longest n that matched (lengths are in decreasing order)
        start = end.gather(1, first[:, None])  # [B, 1]
        chain = self.tokens[(start + torch.arange(depth, device=dev)[None]) % g]  # [B, depth]
        valid = ok_n.any(-1)[:, None] & (chain >= 0).cumprod(1).bool()
        return chain.clamp(min=0), valid

    def fill(self, hist: torch.Tensor, length: torch.Tensor, chain: torch.Tensor, ok: torch.Tensor):
        """The fallback rule (pld's chain inside hybrid, hybrid's merged pool): rows whose own history has no
        match (ok [B, D] all False) take the corpus continuation. Returns (chain, ok, used [B])."""
        if self.empty:
            return chain, ok, torch.zeros_like(ok[:, 0])
        c_chain, c_ok = self.continuation(hist, length, chain.shape[1])
        used = ~ok[:, 0] & c_ok[:, 0]
        return torch.where(used[:, None], c_chain, chain), torch.where(used[:, None], c_ok, ok), used
