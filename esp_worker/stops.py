"""Where each row stops: stop ids, max_new_tokens and the context limit on the device; stop strings on the host.

Reason codes: 0 running, 1 stop (stop id or stop string), 2 length (max_new_tokens), 3 context.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .consts import steps

REASONS = (None, "stop", "length", "context")


def apply_stops(
    committed: torch.Tensor,  # [B, P] tokens committed this pass, valid up to n
    n: torch.Tensor,  # [B]
    stop_table: torch.Tensor,  # [B, V] bool: token v ends row b (`stop_table`)
    hist_len: torch.Tensor,  # [B] tokens so far (prompt + generated)
    limit: torch.Tensor,  # [B] most tokens the row may hold: min(prompt + max_new_tokens, context), `row_limits`
    limit_code: torch.Tensor,  # [B] the reason when the limit cuts: 2 length, 3 context
    limit_far: bool = False,  # no row can reach its limit this pass (host-known): stop ids only
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_final [B], reason [B]): each row's committed tokens cut at the first stop id or at its limit. Tensor
    ops only (six, or nine with the limits, the same every pass); no host read.

    A stop id at slot >= n (a rejected draft's leftover) needs no mask: it cuts after n, and n is the smaller.
    When a stop id and the limit cut at the same token, the reason is the stop.

    Example: committed [[5, 9, 7]], n [3], stop ids [[9]] -> n_final [2], reason [1].
    """
    p = committed.shape[1]
    is_stop = stop_table.gather(1, committed)  # [B, P]
    n_stop = torch.where(is_stop, steps(p, committed.device, start=1), 1 << 30).amin(-1)  # first stop slot + 1
    if limit_far:
        return torch.minimum(n_stop, n), n_stop.le(n).long()
    room = limit - hist_len  # [B]
    n_fin = torch.minimum(torch.minimum(n_stop, room), n)
    reason = torch.where(n_stop == n_fin, 1, torch.where(room == n_fin, limit_code, 0))
    return n_fin, reason


def stop_table(stop_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] bool from stop ids [B, E] (-1 padded; ids outside the vocabulary can never be committed and are
    left out): one lookup per committed token finds the stops, whatever the number of stop ids."""
    b = stop_ids.shape[0]
    ids = torch.where((stop_ids >= 0) & (stop_ids < vocab_size), stop_ids, vocab_size)  # vocab_size: a spare column
    table = torch.zeros((b, vocab_size + 1), dtype=torch.bool, device=stop_ids.device)
    return table.scatter_(1, ids, True)[:, :vocab_size].contiguous()


def row_limits(max_total: torch.Tensor, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(limit [B], limit_code [B]) of rows whose prompt + max_new_tokens is max_total: the length limit (code 2)
    unless the context ends first (code 3; at a tie, the length)."""
    ctx = max_total > max_context
    return torch.where(ctx, max_context, max_total), torch.where(ctx, 3, 2)


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
