"""Walk each draft tree with the model's own choices: accepted nodes + one bonus token per row.

Terms (as in vLLM's rejection sampler): at the current node the model chooses a token (argmax, or a sample
with the request's uniform); if a child of the node carries that token the child is *accepted* and the
walk continues from it, otherwise the chosen token is the *bonus* and the walk stops. Output tokens of a
pass = accepted drafts + bonus = exactly the tokens plain decoding would have produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .tree import DraftTree


@dataclass
class VerifyResult:
    # [B, S] committed tokens per row (accepted drafts then the bonus); valid up to num_committed
    committed: torch.Tensor
    # [B] tokens committed this pass = accepted drafts + 1
    num_committed: torch.Tensor
    # [B, S] tree slots on the accepted path: slot 0 (root) then accepted nodes; valid up to num_committed
    path_slots: torch.Tensor
    # [B] slot of the deepest accepted node (0 = nothing accepted)
    last_slot: torch.Tensor


def verify(
    tree: DraftTree,
    slot_logits: torch.Tensor,  # [B, T, V] float32
    max_depth: int,
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (logits [B, V], active [B]) -> tokens [B]
) -> VerifyResult:
    """Greedy or sampled verification, vectorised over the batch; loops over depth only (<= max_depth + 1)."""
    b = slot_logits.shape[0]
    dev = slot_logits.device
    rows = torch.arange(b, device=dev)
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    active = torch.ones(b, dtype=torch.bool, device=dev)
    num = torch.zeros(b, dtype=torch.long, device=dev)
    committed, path = [], []
    for _ in range(max_depth + 1):
        path.append(cur)
        tok = choose(slot_logits[rows, cur], active)  # [B]
        committed.append(tok)
        num += active.long()
        is_child = (tree.parents == cur[:, None]) & tree.valid & (tree.tokens == tok[:, None])  # [B, T]
        found = is_child.any(-1) & active
        cur = torch.where(found, is_child.long().argmax(-1), cur)
        active = found
        if max_depth and not bool(active.any()):
            break
    return VerifyResult(
        committed=torch.stack(committed, 1),
        num_committed=num,
        path_slots=torch.stack(path, 1),
        last_slot=cur,
    )
