"""`engine.compile_host=true` (CPU): a greedy pass's work after the forward as one compiled kernel.

After the block's forward a greedy pass verifies the tree, cuts each row at its stop ids and limits, writes the
committed tokens to the history and counts the pass: ~30 tensor operations on a few elements each, ~40% of
the host time of an ESP pass at batch 1 on a CPU (each eager operation costs 5-10 us of dispatch there, with
caches cold after the model). `settle` is that work as one function of tensors, made of the engine's own
helpers (`verify_greedy`, `apply_stops`, `write_history`, `count_pass`, `count_by_proposer`); `Settler`
compiles it with AOTInductor (`aot.py`) once per block shape that recurs (the batch and the history's length
are dynamic, so a job compiles a kernel per block size, not per step). When every layer's keys and values live
in the cache's slab, the kernel also moves the kept slots (`kv_cache.move_slots`, the eager `keep`'s own
move), and when the drafter's next `observe` would fold exactly the committed tokens into its mask EMA
(`Drafter.settle_ema`: ESP and the hybrid after a pass that fed masks) it computes that too
(`drafters.common.ema_apply`, the eager step's own function). When every tree slot owns masks (ESP) it also
gathers the hidden states of the masks the last accepted slot owns, which the drafter's probe reads
(`Engine._observe`'s own `mask_indices` / `gather_slots`). The probe's own work after its LM head is the
drafter's second kernel (`drafters/esp.py`, `probe_block`).

The kernel covers greedy rows without stop strings; sampled rows, stop strings, a shape's first passes and
any shape whose compilation fails (logged once) run the phases eagerly. Compiled kernels compute the same
integers as eager ones (argmax, comparisons, indexing: no float rounding), so output is unchanged. Compile
time (~6-10 s per kernel on this CPU) is counted in `compile_s`. A C++ compiler is needed, as for
`torch.compile` on a CPU.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from .aot import AotKernels, require_compiler
from ..batch import Rows, count_by_proposer, count_pass, write_history
from ..consts import steps
from ..drafters import Block
from ..drafters.common import ema_apply
from ..kv_cache import move_slots
from ..stops import apply_stops
from ..tree import DraftTree, gather_slots, mask_indices
from ..verify import VerifyResult, verify_greedy

# settle's inputs, in order (source and accepted_by only with per-proposer counts, the ema_* only when the
# drafter's EMA is computed with the pass, kv only when the kernel moves the kept slots); `_SHARED` may be
# [1, ..] (one for every row) or [B, ..], `_FIXED` have no rows, the others but kv have rows on dim 0; `hist`
# grows on dim 1; kv is the slab [L, 2, R, H, C, D] (R rows, C slots of capacity)
_ARGS = ("tokens", "parents", "valid", "ancestors", "depth", "slot_logits", "stop_table", "hist_len", "limit",
         "limit_code", "hist", "hists", "drafted", "source", "accepted_by", "ema_m", "embed_weight", "ema_cols", "hidden",
         "kv")
_SHARED = ("ancestors", "depth", "source")
_FIXED = ("embed_weight", "ema_cols")


def settle(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, ancestors: torch.Tensor,
           depth: torch.Tensor, slot_logits: torch.Tensor, stop_table: torch.Tensor, hist_len: torch.Tensor,
           limit: torch.Tensor, limit_code: torch.Tensor, hist: torch.Tensor, hists: torch.Tensor,
           drafted: torch.Tensor, source: Optional[torch.Tensor] = None, accepted_by: Optional[torch.Tensor] = None,
           ema_m: Optional[torch.Tensor] = None, embed_weight: Optional[torch.Tensor] = None,
           ema_cols: Optional[torch.Tensor] = None, hidden: Optional[torch.Tensor] = None,
           kv: Optional[torch.Tensor] = None, *, static_key: Optional[tuple], max_depth: int, width: int,
           num_masks: int = 0) -> tuple[torch.Tensor, ...]:
    """Verify (greedy), stop, move the kept KV slots, write the history and count, for a tree [B, T] and its
    slot logits [B, T, V].

    hist [B, H], hists [B, W * W], drafted [B], accepted_by [B, P] (with source, `Rows.count`) and the KV slab
    (with kv: the block was written at slots hist_len - 1 .., `Engine._keep`) are updated in place
    (H >= hist_len + max_depth + 1). With ema_m [B, 1, D] (and the plain embedding's weight [V, D], the EMA's
    weight columns [N+1, 1, 1+S]): also the EMA after each row's kept tokens (`Drafter.settle_ema`). With the
    block's hidden states [B, Q, D] (every slot owns num_masks masks, in slot order): also those of the masks the
    last accepted slot owns, [B, k, D] (what the drafter's probe reads, `Engine._observe`).
    Returns (committed [B, S], num_committed [B], path_slots [B, S], last_slot [B], last_token [B], n_fin [B],
    reason [B], hist_len + n_fin [B] (, the new EMA [B, 1, D]) (, the mask hidden states [B, k, D]))."""
    tree = DraftTree(tokens, parents, valid, static_key=static_key)
    res = verify_greedy(tree, slot_logits, ancestors, depth, max_depth)
    n_fin, reason = apply_stops(res.committed, res.num_committed, stop_table, hist_len, limit, limit_code)
    p = res.path_slots.shape[1] - 1  # path steps after the root
    if kv is not None and p > 0:  # the accepted nodes move right behind each row's root
        torch._check(tokens.shape[0] <= kv.shape[2])  # the batch's rows are the slab's first
        dst = hist_len.unsqueeze(1) + steps(p, hist_len.device)  # [B, P]
        move_slots(kv, 2, dst, res.path_slots.narrow(1, 1, p) + (hist_len.unsqueeze(1) - 1))
    write_history(hist, hist_len, res.committed)
    count_pass(hists, width, drafted, n_fin, res.num_committed, tree.num_drafted())
    if source is not None:
        count_by_proposer(accepted_by, source, res.path_slots, res.num_committed, n_fin)
    out = (res.committed, res.num_committed, res.path_slots, res.last_slot, res.last_token, n_fin, reason,
           hist_len + n_fin)
    if ema_m is not None:  # what the drafter's observe computes from (committed, n_fin), eagerly otherwise
        emb = torch.nn.functional.embedding(res.committed, embed_weight)  # [B, S, D]
        out += (ema_apply(ema_m, emb, ema_cols, n_fin),)
    if hidden is not None:
        out += (gather_slots(hidden, mask_indices(res.last_slot, tokens.shape[1], num_masks)),)
    return out


class _Settle(torch.nn.Module):
    """settle with its host-known arguments fixed: what torch.export traces."""

    def __init__(self, names: tuple[str, ...], static_key: Optional[tuple], max_depth: int, width: int,
                 num_masks: int):
        super().__init__()
        self.names = names
        self.kw = dict(static_key=static_key, max_depth=max_depth, width=width, num_masks=num_masks)

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return settle(**dict(zip(self.names, args)), **self.kw)


class Settled:
    """A compiled settle's outputs: the verification, each row's tokens kept and finish reason, new lengths."""

    __slots__ = ("res", "n_fin", "reason", "hist_len", "kept", "ema_m", "mask_hidden")

    def __init__(self, out: list[torch.Tensor], kept: bool, ema: bool, masks: bool):
        committed, num, path, last_slot, last_token, self.n_fin, self.reason, self.hist_len = out[:8]
        self.res = VerifyResult(committed, num, path, last_slot, last_token)
        self.kept = kept  # the kept KV slots are moved too
        self.ema_m = out[8] if ema else None  # the drafter's EMA after the pass (settle_ema)
        self.mask_hidden = out[-1] if masks else None  # [B, k, D] the masks of the last accepted slot


class Settler:
    """Kernels of `settle`, one per (block shape, depth, counts width); see the module docstring."""

    def __init__(self, device: torch.device):
        require_compiler(device)
        self.kernels = AotKernels("settle")
        self.passes = 0  # decode passes settled by a kernel
        self.ema_passes = 0  # of which the kernel also computed the drafter's EMA
        # (layout, parents, (width, depth), input names, kernel, shapes of the _FIXED inputs) of the last
        # static-tree pass
        self._last: Optional[tuple] = None

    @property
    def compile_s(self) -> float:
        return self.kernels.compile_s

    def __call__(self, rows: Rows, block: Block, slot_logits: torch.Tensor,
                 ema: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                 hidden: Optional[torch.Tensor] = None, num_masks: int = 0) -> Optional[Settled]:
        """The pass settled by the kernel of its shape, or None when the kernel does not cover it (the caller
        runs the phases eagerly). ema: (state [B, 1, D], plain embedding weight [V, D], weight columns) of the
        drafter's EMA to compute with the pass (`Drafter.settle_ema`), or None. hidden: the block's hidden states
        [B, Q, D] when every tree slot owns num_masks masks in slot order: the kernel also gathers the last
        accepted slot's (`Settled.mask_hidden`)."""
        if rows.sampling or rows.has_stop_strings:
            return None
        s = block.max_depth + 1  # a bound on the tokens a row commits (host-known)
        rows.ensure_capacity(s)
        width = rows.count_width(s)
        tree, lay, t = block.tree, block.layout, rows.t
        args = [tree.tokens, tree.parents, tree.valid, lay.visible, lay.depth, slot_logits, t["stop_table"],
                t["hist_len"], t["limit"], t["limit_code"], t["hist"], t["hists"], t["drafted"]]
        names = _ARGS[:13]
        if block.source is not None and "accepted_by" in t:  # per-proposer counts (hybrid)
            args += [block.source, t["accepted_by"]]
            names = _ARGS[:15]
        if ema is not None:
            args += list(ema)
            names += _ARGS[15:18]
        if hidden is not None:
            args.append(hidden)
            names += ("hidden",)
        kv = None if tree.path_in_place else rows.cache.move_target()
        if kv is not None:
            args.append(kv)
            names += ("kv",)
        last = self._last
        fixed = tuple(a.shape for name, a in zip(names, args) if name in _FIXED)  # part of a kernel's key
        if (last is not None and last[0] is lay and last[1] is tree.parents and last[2] == (width, block.max_depth)
                and last[3] == names and last[5] == fixed and tree.tokens.is_contiguous() and tree.valid.is_contiguous()):
            kernel = last[4]  # a static tree's pass like the last: its shared layout and parents, fresh tokens
        else:
            kernel = self._kernel(args, names, tree, lay, block.max_depth, width, num_masks)
            if kernel is None:
                return None
            # the engine's own row tensors are dense; a static tree's layout and parents are built once
            self._last = ((lay, tree.parents, (width, block.max_depth), names, kernel, fixed)
                          if tree.static_key is not None else None)
        out = kernel.boxed_run(args)  # takes the list and empties it
        self.passes += 1
        self.ema_passes += ema is not None
        return Settled(out, kv is not None, ema is not None, hidden is not None)

    def _kernel(self, args: list[torch.Tensor], names: tuple[str, ...], tree: DraftTree, lay: Any, max_depth: int,
                width: int, num_masks: int) -> Optional[Any]:
        """The kernel for this pass's shapes (compiled on first use), or None when there is none."""
        if not all(a.is_contiguous() for a in args):
            return None  # the kernel reads dense rows (never so for the engine's own buffers)
        # _SHARED tensors are [1, ..] (one for every row) or [B, ..]; at batch 1 either counts as shared
        per_row = {name: a.shape[0] != 1 for name, a in zip(names, args) if name in _SHARED}
        kv = args[-1] if names[-1] == "kv" else None
        key = (names, tree.num_slots, tree.static_key, max_depth, width, num_masks, tuple(a.dtype for a in args),
               tuple(per_row.values()), args[5].shape[2],
               *(tuple(a.shape[1:]) for a in (lay.visible, lay.depth, args[6], *args[13:len(args) - (kv is not None)])),
               *(tuple(a.shape) + (a.dtype,) for name, a in zip(names, args) if name in _FIXED),
               None if kv is None else (kv.shape[:2], kv.shape[3], kv.shape[5], kv.dtype))
        dynamic = [{0: "batch", 1: "length"} if name == "hist" else {2: "rows", 4: "slots"} if name == "kv"
                   else {} if name in _FIXED else {0: "batch"} if per_row.get(name, True) else {} for name in names]
        return self.kernels.get(key, lambda: _Settle(names, tree.static_key, max_depth, width, num_masks), args,
                                dynamic)
