"""The job's n-grams: continuations from the requests a job has already finished (hybrid's "corpus" proposer).

A large offline job generates from many prompts of a kind (the same template, the same code base, the same
style); what earlier requests said (their prompts and outputs) predicts what a later one will say where its
own history has no match. The store keeps the latest `capacity` tokens of finished requests in a ring buffer
(`tokens` [G], -1 = separator / empty) and, per n-gram length n, a hash table from an n-gram to the stamp
(absolute write offset) just past its latest occurrence and the n-gram's full hash (`stamps`, `hashes`
[N * H]). Lookups are tensor ops over the rows (no host read); insertion happens when a request finishes,
between passes, once per request.

Lookup (`continuation`): for n from max_ngram down to min_ngram, hash the row's last n tokens (root included),
read the table, check that the slot holds this n-gram's hash (another n-gram in the bucket fails) and has not
been overwritten since, and take the longest n that matches; the draft is the (up to) `depth` tokens that
followed it, stopping at the end of that request.

Example: finished request [5 6 7 8]; a row ending in [.. 9 5 6] with no earlier [5 6] of its own gets the chain
[7 8] (n = 2).

Drafts only steer speed: verification keeps the output exactly plain decoding's whatever the store holds.
The store lives for one `Engine.generate_iter` call (a job, or one shard of it on an actor).
"""
from __future__ import annotations

import torch

PRIME = 2_147_483_647  # 2^31 - 1: the n-gram hash is a polynomial modulo this prime
MULT = 1_000_003


class CorpusNgrams:
    """Ring buffer of finished requests' tokens + per-length n-gram hash tables (see the module docstring)."""

    def __init__(self, capacity: int, max_ngram: int, min_ngram: int, device: torch.device | str = "cpu"):
        if capacity < 1:
            raise ValueError("the corpus needs a capacity >= 1 token")
        if not 1 <= min_ngram <= max_ngram <= 64:
            raise ValueError("corpus n-gram lengths need 1 <= min_ngram <= max_ngram <= 64")
        self.capacity = capacity
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_buckets = 1 << max(10, (2 * capacity - 1).bit_length())  # >= 2 buckets per token
        self.device = torch.device(device)
        self.written = -1
        self._constants()
        self.reset()

    def _constants(self) -> None:
        dev, m = self.device, self.max_ngram
        # MULT^i mod PRIME, newest token first: (t + 1) * power < 2^56 and a sum of m <= 64 terms stays in int64
        self._power = torch.tensor([pow(MULT, i, PRIME) for i in range(m)], dtype=torch.long, device=dev)
        self._lengths = torch.arange(m, self.min_ngram - 1, -1, device=dev)  # [N] n-gram lengths, longest first
        self._rows = (torch.arange(len(self._lengths), device=dev) * self.num_buckets)  # [N] table row offsets
        self._offsets = torch.arange(-m, 0, device=dev)  # [m] a row's last m positions, relative to its length

    def reset(self) -> None:
        """Forget everything (a new job)."""
        if self.written == 0:
            return  # already empty
        n, h = len(self._lengths), self.num_buckets
        self.tokens = torch.full((self.capacity,), -1, dtype=torch.long, device=self.device)  # [G]
        self.stamps = torch.full((n * h,), -1, dtype=torch.long, device=self.device)  # [N * H] just past the latest
        self.hashes = torch.full((n * h,), -1, dtype=torch.long, device=self.device)  # [N * H] the n-gram's full hash
        self.written = 0  # host: stamp of the next write (tokens written so far, separators included)
        self.empty = True

    # ---- hashing -----------------------------------------------------------------------------------
    def _hashes(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [..., m] (oldest first) -> [..., N] hash of the last n tokens, n = max_ngram .. min_ngram.

        hash_n = sum_{i<n} (t_{-1-i} + 1) * MULT^i mod PRIME: one cumulative sum from the newest token back,
        so every length costs the same. A table slot holds the full hash, so two n-grams sharing a bucket are
        told apart (up to 2^-31 per lookup; a false match only costs a draft that verification rejects)."""
        terms = (windows.flip(-1) + 1) * self._power  # [..., m] newest first
        sums = terms.cumsum(-1) % PRIME  # [..., m] hash of the newest 1 .. m tokens
        return sums.flip(-1)[..., : len(self._lengths)]  # lengths m, m-1, .. min_ngram

    # ---- insertion (host side, once per finished request) ------------------------------------------
    def add(self, ids: list[int]) -> None:
        """Append one finished request's tokens (prompt + output) and index its n-grams."""
        g = self.capacity
        ids = ids[len(ids) - (g - 1):] if len(ids) >= g else ids  # the latest g - 1 and a separator fit
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
            padded = torch.cat([torch.zeros((m - 1,), dtype=torch.long, device=self.device), x[:-1]])
            hashes = self._hashes(padded.unfold(0, m, 1))  # [L, N] the n-grams ending at each position
            ends = torch.arange(1, len(ids) + 1, device=self.device)  # [L] exclusive end offset in the request
            fits = ends[:, None] >= self._lengths[None]  # [L, N] the n-gram lies inside the request
            slots = (hashes % self.num_buckets + self._rows)[fits]
            stamps = (self.written + ends)[:, None].expand_as(hashes)[fits]
            # the latest occurrence wins a slot; its hash is written with it
            self.stamps.scatter_reduce_(0, slots, stamps, reduce="amax")
            won = self.stamps[slots] == stamps
            self.hashes[slots[won]] = hashes[fits][won]
        self.written += len(x)
        self.empty = False

    # ---- lookup (tensor ops, no host read) ----------------------------------------------------------
    def continuation(self, hist: torch.Tensor, length: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, depth] tokens, [B, depth] valid, prefix-closed) following the longest match of each row's suffix."""
        g = self.capacity
        suffix = hist.gather(1, (length[:, None] + self._offsets).clamp(min=0))  # [B, m]
        hashes = self._hashes(suffix)  # [B, N]
        slots = hashes % self.num_buckets + self._rows
        stamp = self.stamps[slots]  # [B, N]
        ok = (self.hashes[slots] == hashes) & (stamp > self.written - g) & (length[:, None] >= self._lengths)
        first = ok.long().argmax(-1, keepdim=True)  # [B, 1] the longest n that matched (lengths decrease)
        start = stamp.gather(1, first) % g  # [B, 1] buffer offset just past the n-gram
        chain = self.tokens[(start + torch.arange(depth, device=hist.device)) % g]  # [B, depth]
        valid = ok.any(-1, keepdim=True) & (chain >= 0).cumprod(1).bool()
        return chain.clamp(min=0), valid

    def fill(self, hist: torch.Tensor, length: torch.Tensor, chain: torch.Tensor, ok: torch.Tensor):
        """The fallback rule (pld's chain inside hybrid, hybrid's merged pool): rows whose own history has no
        match (ok [B, D] all False) take the corpus continuation. Returns (chain, ok, used [B])."""
        if self.empty:
            return chain, ok, torch.zeros_like(ok[:, 0])
        c_chain, c_ok = self.continuation(hist, length, chain.shape[1])
        used = ~ok[:, 0] & c_ok[:, 0]
        return torch.where(used[:, None], c_chain, chain), torch.where(used[:, None], c_ok, ok), used
