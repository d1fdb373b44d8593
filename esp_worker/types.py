"""Requests, outputs and per-request statistics: the engine's public contract."""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

FINISH_REASONS = ("stop", "length", "context")
MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (OpenAI's limit, and vLLM's default one)
MAX_SAMPLES = 1024  # the most samples (GenerationParams.n) one prompt may ask for
SEED_RANGE = 1 << 64  # seeds are integers of 64 bits: -2**63 <= seed < 2**64


@dataclass
class GenerationParams:
    max_new_tokens: int = 64  # the one default: jobs take theirs from here
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = off
    seed: Optional[int] = None  # per-request sampling seed; None derives one from the engine seed and id
    stop_token_ids: Sequence[int] = ()  # extra stop ids, on top of the model's EOS ids
    stop_strings: Sequence[str] = ()
    ignore_eos: bool = False
    # return each generated token's log-probability under the model (`RequestOutput.logprobs`): the log-softmax of
    # its raw logits in float32 (temperature 1, before top-p / top-k), read where the token was chosen
    logprobs: bool = False
    # also the `top_logprobs` likeliest tokens at each position with theirs (0 = none; up to MAX_TOP_LOGPROBS);
    # implies logprobs
    top_logprobs: int = 0
    # each prompt token's log-probability given the tokens before it (`RequestOutput.prompt_logprobs`), as logprobs
    prompt_logprobs: bool = False
    # samples per prompt (vLLM's n): a job gives each its own answer in the row's `samples`. The engine decodes one
    # per request: `sample_requests` makes a prompt's n requests. Greedy samples would all be the same: n > 1 needs
    # temperature > 0
    n: int = 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    def __post_init__(self) -> None:
        # one string is one stop string, not a sequence of one-character stops; one id is one stop id
        if isinstance(self.stop_strings, str):
            self.stop_strings = (self.stop_strings,)
        if isinstance(self.stop_token_ids, int) and not isinstance(self.stop_token_ids, bool):
            self.stop_token_ids = (self.stop_token_ids,)

    def problem(self) -> Optional[str]:
        """One-line description of what is invalid, or None."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            return f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1"
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            return f"temperature={self.temperature!r} must be a finite number >= 0"
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            return f"top_p={self.top_p!r} must be in (0, 1]"
        if not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k={self.top_k!r} must be an integer >= 0"
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -(SEED_RANGE >> 1) <= self.seed < SEED_RANGE):
            return f"seed={self.seed!r} must be an integer of 64 bits (-2**63 <= seed < 2**64)"
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            return f"stop_token_ids={list(self.stop_token_ids)!r} must be non-negative integers"
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            return f"stop_strings={list(self.stop_strings)!r} must be non-empty strings"
        if not isinstance(self.logprobs, bool):
            return f"logprobs={self.logprobs!r} must be true or false"
        if not isinstance(self.prompt_logprobs, bool):
            return f"prompt_logprobs={self.prompt_logprobs!r} must be true or false"
        if not isinstance(self.top_logprobs, int) or isinstance(self.top_logprobs, bool) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            return f"top_logprobs={self.top_logprobs!r} must be an integer in 0 .. {MAX_TOP_LOGPROBS}"
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_SAMPLES:
            return f"n={self.n!r} must be an integer in 1 .. {MAX_SAMPLES}"
        if self.n > 1 and self.temperature == 0:
            return f"n={self.n} needs temperature > 0 (greedy samples are all the same)"
        return None


@dataclass
class Request:
    """One generation request. Give `prompt_ids` (already tokenized) or `prompt` (tokenized as
    `tokenizer(prompt)` does, special tokens included)."""

    id: str
    prompt: Optional[str] = None
    prompt_ids: Optional[list[int]] = None
    params: GenerationParams = field(default_factory=GenerationParams)


def default_seed(engine_seed: int, request_id: str) -> int:
    """The sampling seed of a request that gives none: from the engine's seed and the request id, so that a row's
    tokens depend on neither its shard nor the rows beside it."""
    return zlib.crc32(f"{engine_seed}:{request_id}".encode())


def sample_requests(req: Request, engine_seed: int) -> list[Request]:
    """A request's `params.n` samples as n requests of one sample each (the engine decodes one per request).

    Sample i draws from seed + i, where seed is the request's or `default_seed`'s: sample 0 is the answer the same
    request gives with n = 1, and every sample is the same whichever rows share its batches. Sample 0 keeps the
    request id, sample i is `<id>#<i>`; only sample 0 asks for prompt_logprobs (the prompt is the same).

    >>> [(r.id, r.params.seed) for r in sample_requests(Request("q", "Hi", params=GenerationParams(n=3, temperature=1.0, seed=7)), 0)]
    [('q', 7), ('q#1', 8), ('q#2', 9)]
    """
    return [req] if req.params.n == 1 else [sample_request(req, i, engine_seed) for i in range(req.params.n)]


def sample_request(req: Request, i: int, engine_seed: int) -> Request:
    """Sample i of `req`'s params.n samples (see `sample_requests`)."""
    p = req.params
    seed = p.seed if p.seed is not None else default_seed(engine_seed, str(req.id))
    return Request(id=str(req.id) if i == 0 else f"{req.id}#{i}", prompt=req.prompt, prompt_ids=req.prompt_ids,
                   params=replace(p, n=1, seed=_wrapped(seed + i), prompt_logprobs=p.prompt_logprobs and i == 0))


def _wrapped(seed: int) -> int:
    """seed back inside the 64-bit range (seed + i may pass its top)."""
    return seed - SEED_RANGE if seed >= SEED_RANGE else seed


@dataclass
class RequestStats:
    """Counters only; ratios are derived properties. Counters merge by addition.

    decode pass: a forward pass after prefill. Each pass commits accepted drafts + 1 bonus token.
    tau = tokens committed by decode passes / decode passes (prefill's first token is NOT counted).
    """

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of them, copied from a stored shared prefix, not fed (prefix_cache.py)
    num_generated_tokens: int = 0
    num_decode_passes: int = 0
    num_decode_tokens: int = 0  # tokens committed by decode passes (= generated - 1 when prefill gave one)
    num_drafted_tokens: int = 0  # valid draft nodes fed to the model
    num_accepted_drafts: int = 0
    num_drafts: int = 0  # decode passes that fed at least one draft token of this request (vLLM's num_drafts)
    # [depth] passes whose accepted path reached depth d+1
    accepted_per_depth: list[int] = field(default_factory=list)
    # [n] passes that committed n tokens (index 0 unused unless truncated to nothing)
    committed_histogram: list[int] = field(default_factory=list)
    # block size (tokens fed per sequence) -> passes
    block_size_histogram: dict[int, int] = field(default_factory=dict)
    time_s: float = 0.0
    # hybrid: accepted drafts by the proposer that supplied them (ngram | store | esp | corpus); {} otherwise
    accepted_by_proposer: dict[str, int] = field(default_factory=dict)
    # tokens each decode pass committed, in order (len = num_decode_passes, sum = num_decode_tokens); taken from
    # the lengths the pass's one host read returns anyway, so it costs no device read
    committed_per_pass: list[int] = field(default_factory=list)
    # dmtd: layers run for the roots of the decode passes (a cycle start all L, any other root E + D) and L
    num_layers_run: int = 0
    num_model_layers: int = 0

    @property
    def tau(self) -> Optional[float]:
        return self.num_decode_tokens / self.num_decode_passes if self.num_decode_passes else None

    @property
    def plt(self) -> Optional[float]:
        """dmtd: layers per token / the model's layers over the decode passes (1.0 = every layer for every token;
        the paper's PLT); None for other methods."""
        if not self.num_layers_run or not self.num_decode_tokens or not self.num_model_layers:
            return None
        return self.num_layers_run / (self.num_decode_tokens * self.num_model_layers)

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted_drafts / self.num_drafted_tokens if self.num_drafted_tokens else None

    def merge(self, other: "RequestStats") -> "RequestStats":
        def add_lists(a: list[int], b: list[int]) -> list[int]:
            n = max(len(a), len(b))
            return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]

        hist = dict(self.block_size_histogram)
        for k, v in other.block_size_histogram.items():
            hist[k] = hist.get(k, 0) + v
        by = dict(self.accepted_by_proposer)
        for k, v in other.accepted_by_proposer.items():
            by[k] = by.get(k, 0) + v
        return RequestStats(
            num_prompt_tokens=self.num_prompt_tokens + other.num_prompt_tokens,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens + other.num_cached_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens + other.num_generated_tokens,
            num_decode_passes=self.num_decode_passes + other.num_decode_passes,
            num_decode_tokens=self.num_decode_tokens + other.num_decode_tokens,
            num_drafted_tokens=self.num_drafted_tokens + other.num_drafted_tokens,
            num_accepted_drafts=self.num_accepted_drafts + other.num_accepted_drafts,
            num_drafts=self.num_drafts + other.num_drafts,
            accepted_per_depth=add_lists(self.accepted_per_depth, other.accepted_per_depth),
            committed_histogram=add_lists(self.committed_histogram, other.committed_histogram),
            block_size_histogram=hist,
            time_s=self.time_s + other.time_s,
            accepted_by_proposer=by,
            committed_per_pass=self.committed_per_pass + other.committed_per_pass,
            num_layers_run=self.num_layers_run + other.num_layers_run,
            num_model_layers=max(self.num_model_layers, other.num_model_layers),
        )


@dataclass
class RequestOutput:
    id: str
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]  # stop | length | context; None when error is set
    stats: RequestStats
    error: Optional[str] = None
    # [len(token_ids)] float32 log-probability of each generated token (GenerationParams.logprobs), else None
    logprobs: Optional[list[float]] = None
    # per generated token, the GenerationParams.top_logprobs likeliest tokens (id, log-probability), best first
    top_logprobs: Optional[list[list[tuple[int, float]]]] = None
    # [len(prompt)] GenerationParams.prompt_logprobs: each prompt token's log-probability given the tokens before it
    # (None for the first, which has none), else None
    prompt_logprobs: Optional[list[Optional[float]]] = None
