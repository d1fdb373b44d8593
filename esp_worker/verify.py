"""Walk each draft tree with the model's own choices: accepted nodes + one bonus token per row.

Terms (as in vLLM's rejection sampler): at the current node the model chooses a token (argmax, or a sample
with the request's uniform); if a child of the node carries that token the child is *accepted* and the
walk continues from it, otherwise the chosen token is the *bonus* and the walk stops. Output tokens of a
pass = accepted drafts + bonus = exactly the tokens plain decoding would have produced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .consts import constant, ones, steps
from .logprobs import TokenLogprobs
from .sampling import argmax_last
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
    # [B] the last committed token, committed[num_committed - 1] (the next root of a row that goes on); None =
    # not computed here (the rows' view then reads it from the history)
    last_token: Optional[torch.Tensor] = None
    # the committed tokens' log-probabilities under the model (`logprobs.path_logprobs`); None = no row of the pass
    # asked for them
    logprobs: Optional[TokenLogprobs] = None


def verify(
    tree: DraftTree,
    slot_logits: torch.Tensor,  # [B, T, V] float32
    max_depth: int,
    choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],  # (logits [B, V], active [B]) -> tokens [B]
) -> VerifyResult:
    """Greedy or sampled verification, vectorised over the batch; loops over depth only (max_depth + 1 steps,
    with no early exit: finding that every row stopped would need a device read)."""
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
    return VerifyResult(
        committed=torch.stack(committed, 1),
        num_committed=num,
        path_slots=torch.stack(path, 1),
        last_slot=cur,
    )


def verify_greedy(
    tree: DraftTree,
    slot_logits: torch.Tensor,  # [B, T, V] float32
    ancestors: torch.Tensor,  # [B|1, >=T, >=T] bool, ancestors-or-self in its [:, :T, :T] (e.g. the block layout's)
    depth: torch.Tensor,  # [B|1, T]
    max_depth: int,
) -> VerifyResult:
    """Greedy verification without a loop over depth: a node is accepted when every node on its path carries
    its parent's argmax; the deepest accepted node ends the path and its own argmax is the bonus.

    Example: tokens [r, a, b, c], parents [-1, 0, 0, 2], argmax [b, x, c, y] -> b (= argmax of r) and
    c (= argmax of b) are accepted, a is not; committed [b, c, y], path slots [0, 2, 3].
    """
    b, t = tree.tokens.shape
    dev = slot_logits.device
    if max_depth == 1 and t > 1 and not tree.path_in_place:
        # every node hangs under the root (ESP with one mask): only two argmaxes matter
        return _verify_fan(tree, slot_logits)
    target = argmax_last(slot_logits)  # [B, T]
    if t == 1:  # plain decoding: the argmax at the root is the bonus
        return VerifyResult(committed=target, num_committed=ones((b,), torch.long, dev), path_slots=_slots(b, 1, dev),
                            last_slot=_zeros(b, dev), last_token=target.view(b))
    if tree.path_in_place:  # a chain: the accepted drafts are its longest correct prefix
        return _verify_chain(tree, target, max_depth)
    if ancestors.shape[1] != t or ancestors.shape[2] != t:
        ancestors = ancestors[:, :t, :t]
    # the root always (an OR with a constant: a scalar stored by index would be a host-to-device copy, which a
    # CUDA graph capture refuses)
    correct = ((tree.tokens == target.gather(1, tree.parents.clamp(min=0))) & tree.valid) | _root_slot(t, dev)
    accepted = ~(ancestors & ~correct[:, None, :]).any(-1)  # [B, T]: every node on the path is correct
    score = torch.where(accepted, depth.expand(b, t) * t + (t - 1 - torch.arange(t, device=dev)), -1)
    last = score.argmax(-1)  # [B] deepest accepted node, lowest slot first
    on_path = ancestors.expand(b, t, t)[torch.arange(b, device=dev), last]  # [B, T]
    idx = torch.arange(t, device=dev).expand(b, t)
    path = torch.where(on_path, idx, t).sort(dim=1).values[:, : max_depth + 1]  # ancestors in depth order
    path = torch.where(path < t, path, last[:, None])
    return VerifyResult(
        committed=target.gather(1, path),
        num_committed=depth.expand(b, t).gather(1, last[:, None]).squeeze(1) + 1,
        path_slots=path,
        last_slot=last,
        last_token=target.gather(1, last[:, None]).squeeze(1),  # the bonus: the argmax at the deepest accepted node
    )


def _verify_chain(tree: DraftTree, target: torch.Tensor, max_depth: int) -> VerifyResult:
    """verify_greedy for a chain (parents [-1, 0, 1, ..]): node i is accepted when nodes 1..i all carry the
    argmax of the slot before them. Committed and path slots past num_committed are unspecified (as always).
    Example: tokens [r, a, b, c], argmax [a, b, x, y] -> 2 accepted, committed [a, b, x, ..], path [0, 1, 2, ..]."""
    b, t = tree.tokens.shape
    correct = (tree.tokens[:, 1:] == target[:, :-1]) & tree.valid[:, 1:]  # [B, T-1]
    accepted = correct.cumprod(1).sum(1)  # [B]
    s = min(t, max_depth + 1)  # committed width, as verify_greedy's
    return VerifyResult(committed=target[:, :s] if s < t else target, num_committed=accepted + 1,
                        path_slots=_slots(b, s, target.device), last_slot=accepted,
                        last_token=target.gather(1, accepted[:, None]).squeeze(1))


def _verify_fan(tree: DraftTree, slot_logits: torch.Tensor) -> VerifyResult:
    """verify_greedy for a tree of depth 1: the first child carrying the root's argmax is accepted (lowest slot
    first, as verify_greedy), and its own argmax is the bonus. Only those two slots' argmaxes are taken (not
    one per slot), in ~15 tensor ops. Example: tokens [r, a, b], argmax [b, x, y] -> committed [b, y], path [0, 2]."""
    b, t, v = slot_logits.shape
    dev = slot_logits.device
    first = argmax_last(slot_logits.select(1, 0))  # [B] the model's token after the root
    correct = tree.tokens.eq(first.unsqueeze(1)) & tree.valid  # [B, T] (slot 0, the root itself, weighs 0 below)
    last = (correct * _fan_rank(t, dev)).argmax(1)  # [B] the first correct child (0: none, every weight is 0)
    # the accepted slot's logits: rows of the flattened [B * T, V] logits
    bonus = argmax_last(slot_logits.reshape(b * t, v).index_select(0, last + _row_starts(b, t, dev)))
    # nothing accepted (last 0): the "bonus" is slot 0's argmax again, `first`, so the last token is always `bonus`
    return VerifyResult(committed=torch.stack([first, bonus], 1), num_committed=last.clamp(max=1) + 1,
                        path_slots=torch.stack([_zeros(b, dev), last], 1), last_slot=last, last_token=bonus)


def _fan_rank(t: int, dev: torch.device) -> torch.Tensor:
    """[T] 0, T-1, T-2, .., 1: weights under which the first correct child (slot >= 1) is the largest."""
    def make() -> torch.Tensor:
        steps = torch.arange(t, device=dev)
        return torch.where(steps > 0, t - steps, 0)  # no `rank[0] = 0`: a scalar stored by index uploads it
    return constant(("fan_rank", t, dev), make)


def _root_slot(t: int, dev: torch.device) -> torch.Tensor:
    """[T] bool: True at slot 0 only."""
    return constant(("root_slot", t, dev), lambda: steps(t, dev) == 0)


def _zeros(b: int, dev: torch.device) -> torch.Tensor:
    """[B] 0 (slot 0, the root, on every row's path)."""
    return constant(("zeros", b, dev), lambda: torch.zeros(b, dtype=torch.long, device=dev))


def _row_starts(b: int, t: int, dev: torch.device) -> torch.Tensor:
    """[B] 0, T, 2T, ..: each row's first index in a flattened [B * T, ..] tensor."""
    return constant(("row_starts", b, t, dev), lambda: torch.arange(b, device=dev) * t)


def _slots(b: int, t: int, dev: torch.device) -> torch.Tensor:
    """[B, T] 0 .. T-1 per row (a chain's path slots)."""
    return constant(("slots", b, t, dev), lambda: steps(t, dev).expand(b, t))
