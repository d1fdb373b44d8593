"""Where each row stops: stop ids, max_new_tokens and the context limit on the device; stop strings on the host.

Reason codes: 0 running, 1 stop (stop id or stop string), 2 length (max_new_tokens), 3 context.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

REASONS = (None, "stop", "length", "context")


def apply_stops(
    committed: torch.Tensor,  # [B, P] tokens committed this pass, valid up to n
    n: torch.Tensor,  # [B]
    stop_ids: torch.Tensor,  # [B, E] per-row stop ids, -1 padded
    hist_len: torch.Tensor,  # [B] tokens so far (prompt + generated)
    max_total: torch.Tensor,  # [B] prompt + max_new_tokens
    max_context: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_final [B], reason [B]): each row's committed tokens cut at the first stop id, the length or the context
    limit. Tensor ops only; no host read.

    Example: committed [[5, 9, 7]], n [3], stop_ids [[9]] -> n_final [2], reason [1].
    """
    dev = committed.device
    p = committed.shape[1]
    # [B, P] the committed slots that hold a stop id; the first one ends the row (n_stop = its slot + 1)
    is_stop = (committed[..., None] == stop_ids[:, None, :]).any(-1) & (torch.arange(p, device=dev) < n[:, None])
    n_stop = torch.where(is_stop, torch.arange(1, p + 1, device=dev), 1 << 30).amin(-1)
    # candidates in priority order (a stop before the length before the context, when they cut at the same
    # token): the smallest wins, and its code is the reason (n itself: still running)
    cands = torch.stack([n_stop, max_total - hist_len, max_context - hist_len, n], -1)  # [B, 4]
    n_fin = cands.amin(-1)
    reason = _CODES.to(dev)[(cands == n_fin[:, None]).long().argmax(-1)]
    return n_fin, reason


_CODES = torch.tensor([1, 2, 3, 0])  # reason of each candidate of apply_stops


def apply_stop_strings(
    tokenizer: Any,
    stop_strings: Sequence[Sequence[str]],  # per row
    generated: Sequence[list[int]],  # per row: tokens generated before this pass (root included)
    committed: torch.Tensor,  # [B, P]
    n_fin: torch.Tensor,  # [B]
    reason: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut rows whose decoded text now contains a stop string. Needs the text, so it reads the tokens on the
    host: the only per-row host work of a pass, and only when some row has stop strings."""
    n_list = n_fin.tolist()
    new_all = committed.tolist()
    n_fin, reason = n_fin.clone(), reason.clone()
    for r, stops in enumerate(stop_strings):
        if not stops or n_list[r] <= 0:
            continue
        new = new_all[r][: n_list[r]]
        longest = max(len(x) for x in stops)
        base = generated[r][-(longest + 16):]
        before = tokenizer.decode(base, skip_special_tokens=True)
        for j in range(1, len(new) + 1):
            text = tokenizer.decode(base + new[:j], skip_special_tokens=True)
            tail = text[max(0, len(before) - longest):]
            if any(x in tail for x in stops):
                n_fin[r] = j
                reason[r] = 1
                break
    return n_fin, reason
