"""Keys and values of prompt prefixes that recur across a job's requests, kept so that their prefill runs once.

Offline jobs repeat the start of their prompts: a chat template's system header, a shared system prompt, the same
few-shot examples before every question. Under causal attention a position's keys and values depend only on the
tokens up to it, so a prefix's are the same in every prompt that starts with it: a prompt whose start is stored
gets those slots copied into its cache row, and its prefill forward feeds only the rest (`engine.prefix_cache_tokens`,
the engine's `_prefill`).

Which prefixes are stored: those that two or more prompts start with, among the prompts admitted together, the
ones admitted last and the requests still to come (given as token ids: the samples of one prompt), at least
MIN_TOKENS long, each the longest common prefix of its group (`shared_prefixes`). A new
one is computed by a forward of its own when that forward costs less than what it saves the admitted prompts (in
padded tokens, as `prefill_plan.py` counts; on a GPU an eager forward is worth thousands); otherwise it is copied
out of one of its prompts' cache rows after their prefill, for the prompts admitted later (`PrefixReuse`). Past the
budget the least recently used prefixes leave first. A prefix is copied only where it covers enough of the prompt
to pay for the attention mask the copy brings (MIN_SHARE).

A prefix's values come from a forward over another set of rows and lengths than the whole prompt's, so they agree
with that forward's to float rounding, not bitwise: as prompts batched with padding do. The tokens are the model's
own decoding of the prompt either way (tests/engine/test_prefix_cache.py checks them against plain decoding and
`generate`).
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import torch

from . import kv_cache
from .consts import steps
from .grad import inference
from .memory import MemoryShortError, require
from .model.attention import attention_bias

MIN_TOKENS = 16  # the shortest prefix worth storing, and how much more a longer one of a subgroup must share
# A prefill that needs no attention mask of its own (causal attention over the fed tokens alone) needs one once
# a stored prefix is their cached part, and that costs about what feeding 12-13% of the tokens does: on the
# development CPU (esp-tiny-llama, one thread, 48 prompts of 510-770 tokens at batch 8) a shared header of 18 /
# 69 / 137 / 273 tokens made the prefill 7.5% slower / 1% slower / 7.5% faster / 22% faster. So there a stored
# prefix is copied only where it covers at least this share of the prompt tokens (`worth_copying`).
MIN_SHARE = 0.15
RECENT_PROMPTS = 16  # prompts admitted last that a new one's shared prefixes are looked for in (at least the batch)


@dataclass
class Prefix:
    """A stored prompt prefix."""

    ids: tuple[int, ...]  # its tokens
    kv: torch.Tensor  # [L, 2, 1, H, P, D] its keys and values (KVCache.read_prefix)
    used: int = 0  # the store's clock at its last use

    @property
    def length(self) -> int:
        return len(self.ids)


def _common(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest common prefix of `prompts` (two or more)."""
    return len(os.path.commonprefix([list(p) for p in prompts]))


def shared_prefixes(prompts: Sequence[Sequence[int]], min_tokens: int = MIN_TOKENS) -> list[tuple[int, ...]]:
    """The prefixes of at least `min_tokens` tokens that two or more of `prompts` start with: per group of prompts
    that agree on their first `min_tokens` tokens, the group's longest common prefix, short of each member's last
    token (the prefill feeds it for the first token's logits); then, within each group, those of the subgroups
    that share `min_tokens` more, after it. Example (min_tokens 2): [1 2 3 4 5 6], [1 2 3 4 5 7], [1 2 3 8 9],
    [9 9 9] -> (1 2 3), (1 2 3 4 5)."""
    found: list[tuple[int, ...]] = []

    def split(members: list[Sequence[int]], start: int) -> None:  # members share their first `start` tokens
        groups: dict[tuple[int, ...], list[Sequence[int]]] = collections.defaultdict(list)
        for p in members:
            if len(p) - 1 >= start + min_tokens:
                groups[tuple(p[start: start + min_tokens])].append(p)
        for group in groups.values():
            if len(group) < 2:
                continue
            n = min(_common(group), min(len(p) for p in group) - 1)
            found.append(tuple(group[0][:n]))
            split(group, n)

    split(list(prompts), 0)
    return found


class PrefixCache:
    """Stored prefixes by length and tokens, within a budget of tokens (least recently used dropped first)."""

    def __init__(self, budget_tokens: int):
        self.budget = budget_tokens
        self._by_len: dict[int, dict[tuple[int, ...], Prefix]] = {}
        self._clock = 0
        self.tokens = 0  # tokens stored

    def __len__(self) -> int:
        return sum(len(d) for d in self._by_len.values())

    def lookup(self, ids: Sequence[int]) -> Optional[Prefix]:
        """The longest stored prefix of `ids` that leaves at least its last token to feed; marks it used."""
        for n in sorted(self._by_len, reverse=True):
            if n < len(ids):
                hit = self._by_len[n].get(tuple(ids[:n]))
                if hit is not None:
                    self._clock += 1
                    hit.used = self._clock
                    return hit
        return None

    def has(self, ids: tuple[int, ...]) -> bool:
        return ids in self._by_len.get(len(ids), {})

    def add(self, ids: tuple[int, ...], kv: torch.Tensor) -> Optional[Prefix]:
        """Store `ids` (its keys and values `kv`); None when it exceeds the whole budget. Makes room first."""
        if self.has(ids):
            return self._by_len[len(ids)][ids]
        if len(ids) > self.budget:
            return None
        while self.tokens + len(ids) > self.budget:
            self._drop_oldest()
        self._clock += 1
        entry = Prefix(ids, kv, self._clock)
        self._by_len.setdefault(len(ids), {})[ids] = entry
        self.tokens += len(ids)
        return entry

    def _drop_oldest(self) -> None:
        oldest = min((e for d in self._by_len.values() for e in d.values()), key=lambda e: e.used)
        del self._by_len[oldest.length][oldest.ids]
        if not self._by_len[oldest.length]:
            del self._by_len[oldest.length]
        self.tokens -= oldest.length

    def nbytes(self) -> int:
        return sum(e.kv.numel() * e.kv.element_size() for d in self._by_len.values() for e in d.values())


def worth_copying(cached: int, total: int, masked_anyway: bool) -> bool:
    """Whether copying `cached` of `total` prompt tokens beats feeding them (MIN_SHARE), for a prefill that would
    take an attention mask anyway (`masked_anyway`: eager attention, a sliding window) or would not."""
    return cached > 0 and (masked_anyway or cached >= MIN_SHARE * total)


def _joining(seqs: list["Admitted"], upcoming: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """The upcoming prompts that start as an admitted one does (their first MIN_TOKENS tokens): the only ones that
    can share a prefix with it. They are not validated yet (the engine checks a request when it is taken), so one
    that is not a sequence of ints is left out."""
    starts = {tuple(s.prompt_ids[:MIN_TOKENS]) for s in seqs}
    return [ids for ids in upcoming
            if isinstance(ids, (list, tuple)) and len(ids) > MIN_TOKENS and all(type(t) is int for t in ids[:MIN_TOKENS])
            and tuple(ids[:MIN_TOKENS]) in starts and all(type(t) is int for t in ids)]


def starts_with(ids: Sequence[int], prefix: tuple[int, ...]) -> bool:
    return len(ids) > len(prefix) and tuple(ids[: len(prefix)]) == prefix


class Admitted(Protocol):
    """An admitted request as `PrefixReuse` sees it (batch.Seq)."""

    req: Any  # types.Request
    prompt_ids: list[int]
    prefix: Optional[Prefix]  # the stored prefix its prefill copies


class PrefillCounters(Protocol):
    """Where a prefix's own forward is counted (stats.EngineStats)."""

    prefill_forwards: int
    prefill_tokens: int
    prefill_s: float


class PrefixReuse:
    """What the engine's prefill asks of the store: which stored prefix each admitted prompt copies (`assign`), and
    the shared prefixes the store lacks, computed by a forward of their own where that pays or else taken from a
    prompt's cache row after its prefill (`capture`)."""

    def __init__(self, runner: Any, num_layers: int, budget_tokens: int, forward_tokens: float, slot_bytes: int,
                 stats: PrefillCounters, max_batch_size: int):
        self.store = PrefixCache(budget_tokens)
        self.runner, self.num_layers, self.stats = runner, num_layers, stats
        self.forward_tokens = forward_tokens  # a prefill forward's fixed cost in padded tokens (prefill_plan.py)
        self.slot_bytes = slot_bytes  # one position's keys and values, every layer
        # the prefill takes an attention mask whether or not it copies a prefix (eager attention, a sliding window)
        self.masked_anyway = runner.prefill_needs_mask
        self._unstored: list[tuple[int, ...]] = []  # shared prefixes of this admission to take from a prefilled row
        # the prompts admitted last: a prompt admitted alone finds the prefixes it shares with them
        self._recent: collections.deque = collections.deque(maxlen=max(RECENT_PROMPTS, max_batch_size))

    def worth(self, cached: int, total: int) -> bool:
        return worth_copying(cached, total, self.masked_anyway)

    @property
    def lookahead(self) -> int:
        """How many of the requests still to come `assign` is shown."""
        return self._recent.maxlen or 0

    @inference
    def assign(self, seqs: list[Admitted], upcoming: Sequence[Sequence[int]] = ()) -> None:
        """Set each admitted prompt's longest stored prefix worth copying (`Seq.prefix`; none for a prompt whose
        log-probabilities are asked: its prefill reads every position). Of the prefixes the store lacks that the
        prompts share, with each other, with the prompts admitted last or with the `upcoming` ones (still to be
        taken: the samples of one prompt that join one by one), those whose forward of their own costs less than
        it saves these prompts (in padded tokens, as the chunks are planned) are computed now; the others are taken
        from a prompt's cache row after its prefill (`capture`), for the prompts to come."""
        store = self.store
        for s in seqs:
            s.prefix = None if s.req.params.prompt_logprobs else store.lookup(s.prompt_ids)
            if s.prefix is not None and not self.worth(s.prefix.length, len(s.prompt_ids)):
                s.prefix = None
        self._unstored = []
        for ids in shared_prefixes([s.prompt_ids for s in seqs] + list(self._recent) + _joining(seqs, upcoming)):
            mine = [] if store.has(ids) else [s for s in seqs if starts_with(s.prompt_ids, ids)]
            if not mine:
                continue
            members = [s for s in mine if not s.req.params.prompt_logprobs and self.worth(len(ids), len(s.prompt_ids))]
            saved = sum(max(0, len(ids) - (0 if s.prefix is None else s.prefix.length)) for s in members)
            if saved <= len(ids) + self.forward_tokens:
                self._unstored.append(ids)
                continue
            entry = self._keep(ids, self._compute(ids))
            for s in members:
                if entry is not None and (s.prefix is None or s.prefix.length < entry.length):
                    s.prefix = entry
        self._recent.extend(s.prompt_ids for s in seqs)

    def capture(self, seqs: list[Admitted], row0: int, cache: "kv_cache.KVCache") -> None:
        """After the prefill of `seqs` (rows row0 .. of `cache`): store each shared prefix left for then from the
        first of them that starts with it."""
        for ids in list(self._unstored):
            row = next((i for i, s in enumerate(seqs) if starts_with(s.prompt_ids, ids)), None)
            if row is not None:
                self._unstored.remove(ids)
                self._keep(ids, cache.read_prefix(row0 + row, len(ids)))

    def _compute(self, ids: tuple[int, ...]) -> Optional[torch.Tensor]:
        """The keys and values of `ids` alone: a prefill forward of one row into a cache of its own."""
        start, n, runner = time.perf_counter(), len(ids), self.runner
        dev = runner.device
        cache = kv_cache.new_cache(self.num_layers)
        cache.reserve(1, n)
        cache.plan(0, 1, n, 0)
        pos = steps(n, dev)[None]
        bias = None
        if self.masked_anyway:
            causal = steps(n, dev)[:, None] >= steps(n, dev)[None, :]
            bias = attention_bias(causal[None], None, pos, n, runner.dtype, runner.sliding_window)
        embeds = runner.embed_ids(torch.tensor([ids], dtype=torch.long, device=dev))
        runner.forward(embeds, bias, pos, cache, n - 1, keep=pos[:, -1:])
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += n
        self.stats.prefill_s += time.perf_counter() - start
        return cache.read_prefix(0, n)

    def _keep(self, ids: tuple[int, ...], kv: Optional[torch.Tensor]) -> Optional[Prefix]:
        """Store `ids`' keys and values (None: the cache cannot give them), unless the device lacks twice their size
        (the batch's cache comes first)."""
        if kv is None:
            return None
        try:
            require(f"engine.prefix_cache_tokens: a prefix of {len(ids)} tokens", 2 * self.slot_bytes * len(ids), "",
                    kv.device)
        except MemoryShortError:
            return None
        return self.store.add(ids, kv)
