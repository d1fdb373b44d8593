"""Log-probabilities under the model: of the committed tokens (GenerationParams.logprobs / top_logprobs) and of
the prompts' own (prompt_logprobs, at the prefill).

A pass's committed tokens are the model's own choices at the slots of its accepted path: committed[:, j] was
chosen (argmax or sample) at path_slots[:, j], the root's slot first, so an accepted draft is read at its parent's
logits and the bonus token at the deepest accepted node's, exactly where plain decoding would have chosen each.
Their log-probabilities are the float32 log-softmax of the raw logits there (temperature 1, before top-p / top-k,
as vLLM reports them by default), and so are the K likeliest alternatives'.

    slot_logits [B, T, V], path_slots [[0, 2]], committed [[7, 3]] -> chosen [[log p_0(7), log p_2(3)]]

The logits are indexed, not gathered into [B, S, V] (at V = 128k, S = 48 and 64 rows that is gigabytes); the
normaliser is one logsumexp per tree slot, the alternatives one top-k per slot.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .consts import steps


@dataclass
class TokenLogprobs:
    """One pass's log-probabilities of its committed tokens, rows first; entries past a row's committed count are
    never read."""

    chosen: torch.Tensor  # [B, S] float32 each committed token's
    top_ids: Optional[torch.Tensor] = None  # [B, S, K] int32 the K likeliest tokens where each was chosen, best first
    top: Optional[torch.Tensor] = None  # [B, S, K] float32 their log-probabilities

    def tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        return self.chosen, self.top_ids, self.top

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TokenLogprobs":
        return TokenLogprobs(*(None if t is None else fn(t) for t in self.tensors()))

    @staticmethod
    def cat(parts: list["TokenLogprobs"]) -> "TokenLogprobs":
        """Tokens chosen one after another (DMTD's cycle), side by side along S."""
        columns = zip(*(p.tensors() for p in parts))  # each field's tensors, part by part
        return TokenLogprobs(*(None if ts[0] is None else torch.cat(ts, 1) for ts in columns))


def path_logprobs(slot_logits: torch.Tensor, path_slots: torch.Tensor, committed: torch.Tensor,
                  top: int = 0) -> TokenLogprobs:
    """The committed tokens' log-probabilities (and the `top` likeliest alternatives') at the slots they were chosen
    at (module docstring). slot_logits [B, T, V] float32; path_slots, committed [B, S]."""
    b, t, v = slot_logits.shape
    slots = path_slots.clamp(0, t - 1)
    norm = torch.logsumexp(slot_logits, -1)  # [B, T]
    rows = steps(b, slot_logits.device).unsqueeze(1)  # [B, 1]
    chosen = (slot_logits[rows, slots, committed.clamp(0, v - 1)] - norm.gather(1, slots)).float()
    if not top:
        return TokenLogprobs(chosen)
    best = slot_logits.topk(top, dim=-1)  # [B, T, K] per slot, best first
    at = slots.unsqueeze(2).expand(-1, -1, top)  # [B, S, K]
    values = (best.values - norm.unsqueeze(2)).gather(1, at).float()
    return TokenLogprobs(chosen, best.indices.gather(1, at).int(), values)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int = 0) -> TokenLogprobs:
    """Tokens [B, S] chosen one after another at logits [B, S, V] (a prefill's first token, DMTD's cycle)."""
    b, s = tokens.shape
    return path_logprobs(logits, steps(s, tokens.device).expand(b, s), tokens, top)


# the logits a prompt's log-probabilities are computed from at once, per prefill forward (bytes): the LM head runs
# over the prompts' positions in chunks of this size ([R, L, V] float32 for 16 prompts of 1,000 tokens and a
# 128k vocabulary would be 8 GB)
PROMPT_CHUNK_BYTES = 256 << 20


def prompt_logprobs(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, ids: torch.Tensor,
                    vocab: int) -> torch.Tensor:
    """[R, L - 1] float32: each prompt token's log-probability given the tokens before it, ids[:, j + 1] at
    position j's logits, the LM head run over PROMPT_CHUNK_BYTES of logits at a time. head: hidden [.., D] ->
    float32 logits [.., vocab]; hidden [R, >= L, D] a prefill's final hidden states; ids [R, L] the prompts (past
    a prompt's end the entries are garbage, never read)."""
    r, n = ids.shape
    step = max(1, PROMPT_CHUNK_BYTES // (4 * r * vocab))
    out = [chosen_logprobs(head(hidden[:, a: min(a + step, n - 1)]), ids[:, a + 1: min(a + step, n - 1) + 1]).chosen
           for a in range(0, n - 1, step)]
    return torch.cat(out, 1) if out else torch.zeros((r, 0), dtype=torch.float32, device=ids.device)
