"""Draft trees and the block layout built from them, with tensor ops only.

A draft tree per sequence has T = 1 + N slots: slot 0 is the root (the last committed token, not yet in the
KV cache), slots 1..N are draft nodes in topological order (a parent's slot < its child's slot).
`parents[b, i]` is the parent slot of slot i (-1 for the root). A chain is parents [-1, 0, 1, 2, ...].

Block layout fed to the model per sequence (Q = T * (k + 1) tokens):
    [slot 0 .. slot N, mask(0,1) .. mask(0,k), mask(1,1) .. mask(N,k)]
mask (u, j) sits at position pos(u) + j and sees the cache, u's ancestors, u itself and masks (u, 1..j-1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .consts import constant, ones, steps


@dataclass
class DraftTree:
    """A batch of draft trees of one shape [B, T]; invalid slots are padding (never accepted)."""

    # [B, T] token ids (slot 0 = root token)
    tokens: torch.Tensor
    # [B, T] parent slot, -1 at slot 0
    parents: torch.Tensor
    # [B, T] bool, False for padding nodes (slot 0 always True)
    valid: torch.Tensor
    # True when every row shares one shape that never changes between passes (static tree): the in-block
    # mask and relative positions can then be cached.
    static_key: Optional[tuple] = None

    @property
    def num_slots(self) -> int:
        return self.tokens.shape[1]

    def num_drafted(self) -> Optional[torch.Tensor]:
        """[B] valid draft nodes per row (None for a root-only tree: nothing drafted)."""
        t = self.num_slots
        return self.valid.narrow(1, 1, t - 1).sum(-1) if t > 1 else None

    @property
    def path_in_place(self) -> bool:
        """Root-only trees and chains: the accepted path is slots 0, 1, 2, ... (no KV slot ever moves)."""
        return self.static_key is not None and self.static_key[0] in ("root", "chain")

    @staticmethod
    def root_only(root_tokens: torch.Tensor) -> "DraftTree":
        # root_tokens: [B]; parents and valid are shared constants per (B, device): never modify them in place
        b = root_tokens.shape[0]
        dev = root_tokens.device
        parents = constant(("root_parents", b, dev), lambda: torch.full((b, 1), -1, dtype=torch.long, device=dev))
        return DraftTree(tokens=root_tokens.unsqueeze(1), parents=parents, valid=ones((b, 1), torch.bool, dev),
                         static_key=("root",))


def best_nodes(
    root: torch.Tensor, rank: torch.Tensor, ok: torch.Tensor, tok: torch.Tensor, par: torch.Tensor, num_nodes: int
) -> tuple["DraftTree", torch.Tensor]:
    """The one tree-selection helper (ESP's Algorithm 1, STAND and hybrid): keep the `num_nodes` pool entries of
    highest `rank` as a tree. Pool order must be topological and no entry may outrank its parent (a stable sort
    then keeps a parent ahead of an equal-ranked child, so the kept set is a tree).

    root [B]; rank, ok, tok, par [B, P] (par = parent pool index, -1 = root; ok False = invalid node).
    Returns (tree with 1 + num_nodes slots, keep [B, n] pool index of each kept slot 1..n in slot order).
    A kept entry whose parent was not kept (only possible for invalid, equally-ranked entries) hangs under the
    root and is invalid. A pool smaller than the budget is padded with invalid leaves under the root.
    Example: rank [0, -1, 0, -2], par [-1, -1, 0, 0], num_nodes 2 -> pool entries 0 and 2 ->
    tokens [root, tok0, tok2], parents [-1, 0, 1].
    """
    b, p = rank.shape
    dev = rank.device
    n = min(num_nodes, p)
    keep = rank.sort(dim=1, descending=True, stable=True).indices[:, :n].sort(dim=1).values  # [B, n]
    slot_of = torch.full((b, p), -1, dtype=torch.long, device=dev)
    slot_of.scatter_(1, keep, steps(n, dev, 1).expand(b, -1))
    kept_par = par.gather(1, keep)
    parent_slot = torch.where(kept_par < 0, 0, slot_of.gather(1, kept_par.clamp(min=0)))
    orphan = parent_slot < 0
    parent_slot = parent_slot.clamp(min=0)
    tokens = torch.cat([root[:, None], tok.gather(1, keep)], 1)
    parents = torch.nn.functional.pad(parent_slot, (1, 0), value=-1)
    valid = torch.nn.functional.pad(ok.gather(1, keep) & ~orphan, (1, 0), value=True)
    if n < num_nodes:
        pad = num_nodes - n
        tokens = torch.nn.functional.pad(tokens, (0, pad))
        parents = torch.nn.functional.pad(parents, (0, pad))
        valid = torch.nn.functional.pad(valid, (0, pad))
    return DraftTree(tokens, parents, valid, static_key=None), keep


def ancestor_matrix(parents: torch.Tensor, max_depth: Optional[int] = None) -> torch.Tensor:
    """[B, T] parents -> [B, T, T] bool, anc[b, i, j] = slot j is slot i or one of its ancestors.

    Example: parents [-1, 0, 0, 1] -> rows: 0:{0}, 1:{0,1}, 2:{0,2}, 3:{0,1,3}.
    Built by repeated squaring of the parent relation: ceil(log2(depth)) batched matmuls, the depth being
    max_depth when the caller knows a bound on the tree's (else T - 1).
    """
    b, t = parents.shape
    depth = t - 1 if max_depth is None else min(max_depth, t - 1)
    eye = torch.eye(t, dtype=torch.float32, device=parents.device).expand(b, t, t)
    step = torch.zeros((b, t, t + 1), dtype=torch.float32, device=parents.device)
    step.scatter_(2, (parents.clamp(min=-1) % (t + 1))[..., None], 1.0)  # -1 -> column t (dropped)
    reach = eye + step[..., :t]
    for _ in range(max(1, (depth - 1).bit_length())):  # after r rounds: paths of up to 2^r edges
        reach = torch.clamp(reach + torch.bmm(reach, reach), max=1.0)
    return reach > 0


@dataclass
class BlockLayout:
    """In-block attention and relative positions for trees of one shape."""

    # [B or 1, Q, Q] bool: in-block visibility
    visible: torch.Tensor
    # [B or 1, Q] position offset from the root's position
    rel_pos: torch.Tensor
    # [B or 1, T] depth of each tree slot
    depth: torch.Tensor
    num_slots: int
    num_masks: int
    max_depth: Optional[int] = None  # deepest slot (host int), filled in for cached static layouts


def block_layout(parents: torch.Tensor, num_masks: int, owners: Optional[torch.Tensor] = None,
                 max_depth: Optional[int] = None) -> BlockLayout:
    """Build the in-block mask and relative positions for a batch of trees with k = num_masks.

    owners [B, M]: the slots that own masks (hybrid: the root and the likeliest ends of the accepted path);
    None = every slot. Masks follow the tree slots, k per owner, in owner order. max_depth: a bound on the
    trees' depth, where the caller knows one (fewer rounds in `ancestor_matrix`).
    Example (T=2, parents [-1, 0], k=1): order [r, n1, m(r), m(n1)], rel_pos [0, 1, 1, 2];
    m(r) sees {r, m(r)}, m(n1) sees {r, n1, m(n1)}.
    """
    b, t = parents.shape
    k = num_masks
    dev = parents.device
    anc = ancestor_matrix(parents, max_depth)  # [B, T, T]
    depth = anc.sum(-1) - 1  # [B, T]
    if owners is not None:
        m = owners.shape[1]
        own_anc = anc.gather(1, owners[..., None].expand(-1, -1, t))  # [B, M, T]
        own_depth = depth.gather(1, owners)  # [B, M]
    else:
        m, own_anc, own_depth = t, anc, depth
    q = t + m * k
    visible = torch.zeros((b, q, q), dtype=torch.bool, device=dev)
    visible[:, :t, :t] = anc
    if k:
        # mask rows see their owner's ancestors-or-self
        visible[:, t:, :t] = own_anc[:, :, None].expand(-1, -1, k, -1).reshape(b, m * k, t)  # each owner k times
        # and their own earlier masks (block-diagonal lower-triangular k x k)
        chain = torch.tril(torch.ones((k, k), dtype=torch.bool, device=dev))
        visible[:, t:, t:] = torch.block_diag(*([chain] * m))[None] if m > 1 else chain[None]
    j = torch.arange(1, k + 1, device=dev)
    mask_pos = (own_depth[:, :, None] + j).reshape(b, m * k)  # [B, M*k]
    rel_pos = torch.cat([depth, mask_pos], dim=1)
    return BlockLayout(visible=visible, rel_pos=rel_pos, depth=depth, num_slots=t, num_masks=k)


def mask_indices(slot: torch.Tensor, num_slots: int, num_masks: int) -> torch.Tensor:
    """Block indices of the k masks owned by `slot` ([B] -> [B, k])."""
    if num_masks == 1:
        return (slot + num_slots).unsqueeze(1)
    j = torch.arange(num_masks, device=slot.device)
    return num_slots + slot.unsqueeze(1) * num_masks + j


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, Q, D] at block indices idx [B, K] -> [B, K, D]."""
    return x.gather(1, idx.unsqueeze(2).expand(-1, -1, x.shape[2]))


def static_branches(block_complexity: int, num_masks: int) -> list[int]:
    """Branch list [K_1..K_k] (top-1 expansion) filling the block: N = BC // (k+1) - 1 nodes.

    BC 10, k=1 -> [4]; BC 30, k=1 -> [14]; BC 60, k=2 -> [15, 4]; BC 30, k=2 -> [7, 2] (the paper's trees).
    Deeper levels get ~20% then ~10% of the nodes, at least 1 each; a tree too small for k levels is shallower.
    """
    n = block_complexity // (num_masks + 1) - 1
    if n < 1:
        raise ValueError(f"block_complexity={block_complexity} leaves no draft node with num_masks={num_masks}")
    shares = [0.2, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05][: max(0, num_masks - 1)]
    deeper = [max(1, round(n * s)) for s in shares]
    while deeper and n - sum(deeper) < 1:
        deeper.pop()
    return [n - sum(deeper)] + deeper


def static_parents(branches: list[int]) -> list[int]:
    """Parent slots of a top-1-expansion tree: depth d+1 nodes hang under the first node of depth d.

    [3, 2] -> [-1, 0, 0, 0, 1, 1] (slots: root, three depth-1, two depth-2 under slot 1).
    """
    parents = [-1]
    first_of_prev = 0
    for k in branches:
        start = len(parents)
        parents.extend([first_of_prev] * k)
        first_of_prev = start
    return parents
