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
import dataclasses
from dataclasses import dataclass

from ..batch import Rows, count_by_proposer, count_pass, write_history
from ..consts import steps
from ..drafters.common import ema_apply
from ..kv_cache import move_slots
from ..passes import Block, Settled
from ..stops import apply_stops
from ..tree import DraftTree, gather_slots, mask_indices
from ..verify import VerifyResult, verify_greedy


@dataclass
class SettleArgs:
    """settle's tensors. Rows on dim 0 ([B, ..]) but for the `shared` ones ([1, ..] or [B, ..]), the `fixed` ones
    (no rows) and kv; `hist` grows on dim 1. Optional groups: source + accepted_by (per-proposer counts), the
    ema_* (the drafter's EMA computed with the pass), hidden (the masks' hidden states gathered), kv (the kept
    slots moved)."""

    tokens: torch.Tensor  # [B, T] the tree
    parents: torch.Tensor  # [B, T]
    valid: torch.Tensor  # [B, T] bool
    ancestors: torch.Tensor  # [B|1, Q, Q] bool: the layout's visibility
    depth: torch.Tensor  # [B|1, T]
    slot_logits: torch.Tensor  # [B, T, V]
    stop_table: torch.Tensor  # [B, V] bool
    hist_len: torch.Tensor  # [B]
    limit: torch.Tensor  # [B]
    limit_code: torch.Tensor  # [B]
    hist: torch.Tensor  # [B, H], H >= hist_len + max_depth + 1, written in place
    hists: torch.Tensor  # [B, W * W] pass counts, in place
    drafted: torch.Tensor  # [B, 2] in place
    source: Optional[torch.Tensor] = None  # [B|1, T] proposer of each slot
    accepted_by: Optional[torch.Tensor] = None  # [B, P] in place
    ema_m: Optional[torch.Tensor] = None  # [B, 1, D]
    embed_weight: Optional[torch.Tensor] = None  # [V, D] the plain input embedding
    ema_cols: Optional[torch.Tensor] = None  # [N+1, 1, 1+S] the EMA's weight columns (N grows with the largest gap)
    hidden: Optional[torch.Tensor] = None  # [B, Q, D] the block's hidden states (every slot owns k masks)
    kv: Optional[torch.Tensor] = None  # [L, 2, R, H, C, D] the cache's slab (R rows, C slots), in place

    SHARED = ("ancestors", "depth", "source")
    FIXED = ("embed_weight", "ema_cols")

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """The set tensors in field order (the kernel's inputs)."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if getattr(self, f.name) is not None]


@dataclass(frozen=True)
class SettleSpec:
    """settle's host-known arguments (part of a kernel's key)."""

    static_key: Optional[tuple]  # the tree's static shape, or None
    max_depth: int  # a bound on every row's accepted depth
    width: int  # the pass counts' width W
    num_masks: int = 0  # masks per tree slot (with hidden)


def settle(a: SettleArgs, spec: SettleSpec) -> tuple[torch.Tensor, ...]:
    """Verify (greedy), stop, move the kept KV slots, write the history and count, in place where `SettleArgs`
    says so. Returns (committed [B, S], num_committed [B], path_slots [B, S], last_slot [B], last_token [B],
    n_fin [B], reason [B], hist_len + n_fin [B]) (+ the new EMA [B, 1, D]) (+ the mask hidden states [B, k, D])."""
    tree = DraftTree(a.tokens, a.parents, a.valid, static_key=spec.static_key)
    res = verify_greedy(tree, a.slot_logits, a.ancestors, a.depth, spec.max_depth)
    n_fin, reason = apply_stops(res.committed, res.num_committed, a.stop_table, a.hist_len, a.limit, a.limit_code)
    p = res.path_slots.shape[1] - 1  # path steps after the root
    if a.kv is not None and p > 0:  # the accepted nodes move right behind each row's root
        torch._check(a.tokens.shape[0] <= a.kv.shape[2])  # the batch's rows are the slab's first
        dst = a.hist_len.unsqueeze(1) + steps(p, a.hist_len.device)  # [B, P]
        move_slots(a.kv, 2, dst, res.path_slots.narrow(1, 1, p) + (a.hist_len.unsqueeze(1) - 1))
    write_history(a.hist, a.hist_len, res.committed)
    count_pass(a.hists, spec.width, a.drafted, n_fin, res.num_committed, tree.num_drafted())
    if a.source is not None:
        count_by_proposer(a.accepted_by, a.source, res.path_slots, res.num_committed, n_fin)
    out = (res.committed, res.num_committed, res.path_slots, res.last_slot, res.last_token, n_fin, reason,
           a.hist_len + n_fin)
    if a.ema_m is not None:  # what the drafter's observe computes from (committed, n_fin), eagerly otherwise
        emb = torch.nn.functional.embedding(res.committed, a.embed_weight)  # [B, S, D]
        out += (ema_apply(a.ema_m, emb, a.ema_cols, n_fin),)
    if a.hidden is not None:
        out += (gather_slots(a.hidden, mask_indices(res.last_slot, a.tokens.shape[1], spec.num_masks)),)
    return out


class _Settle(torch.nn.Module):
    """settle with its host-known arguments fixed: what torch.export traces."""

    def __init__(self, names: tuple[str, ...], spec: SettleSpec):
        super().__init__()
        self.names, self.spec = names, spec

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return settle(SettleArgs(**dict(zip(self.names, args))), self.spec)


@dataclass(frozen=True)
class _KernelKey:
    """What makes a static tree's pass use the same kernel as the last one (`Settler._last`)."""

    static_key: tuple
    names: tuple[str, ...]
    width: int
    max_depth: int
    fixed: tuple  # shapes of the FIXED inputs
    per_row: tuple  # which SHARED inputs have a row each (else one for every row)
    dtypes: tuple


class Settler:
    """Kernels of `settle`, one per (block shape, depth, counts width); see the module docstring."""

    def __init__(self, device: torch.device):
        require_compiler(device)
        self.kernels = AotKernels("settle")
        self.passes = 0  # decode passes settled by a kernel
        self.ema_passes = 0  # of which the kernel also computed the drafter's EMA
        self._static: dict[_KernelKey, Any] = {}  # static trees' kernels, found without building the full key

    @property
    def compile_s(self) -> float:
        return self.kernels.compile_s

    def __call__(self, rows: Rows, block: Block, slot_logits: torch.Tensor,
                 ema: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
                 hidden: Optional[torch.Tensor] = None, num_masks: int = 0) -> Optional[Settled]:
        """The pass settled by the kernel of its shape, or None when the kernel does not cover it (the caller
        runs the phases eagerly). Applies everything the eager phases would: history, counts, the kept KV slots
        and the rows' new lengths and roots. ema: (state [B, 1, D], plain embedding weight [V, D], weight
        columns) of the drafter's EMA to compute with the pass (`KernelHooks.settle_ema`), or None. hidden: the
        block's hidden states [B, Q, D] when every tree slot owns num_masks masks in slot order: the kernel also
        gathers the last accepted slot's (`Settled.mask_hidden`)."""
        if rows.sampling or rows.has_stop_strings:
            return None
        s = block.max_depth + 1  # a bound on the tokens a row commits (host-known)
        rows.ensure_capacity(s)
        width = rows.count_width(s)
        tree, lay, t = block.tree, block.layout, rows.t
        per_proposer = block.source is not None and t.accepted_by is not None
        ema_m, embed_weight, ema_cols = ema if ema is not None else (None, None, None)
        args = SettleArgs(tree.tokens, tree.parents, tree.valid, lay.visible, lay.depth, slot_logits, t.stop_table,
                          t.hist_len, t.limit, t.limit_code, t.hist, t.hists, t.drafted,
                          source=block.source if per_proposer else None,
                          accepted_by=t.accepted_by if per_proposer else None,
                          ema_m=ema_m, embed_weight=embed_weight, ema_cols=ema_cols, hidden=hidden,
                          kv=None if tree.path_in_place else rows.cache.move_target())
        named = args.named()
        names = tuple(n for n, _ in named)
        tensors = [a for _, a in named]
        spec = SettleSpec(tree.static_key, block.max_depth, width, num_masks)
        kernel = None
        if tree.static_key is not None and tree.tokens.is_contiguous() and tree.valid.is_contiguous():
            key = _KernelKey(tree.static_key, names, width, block.max_depth,
                             tuple(a.shape for n, a in named if n in SettleArgs.FIXED),
                             tuple(a.shape[0] != 1 for n, a in named if n in SettleArgs.SHARED),
                             tuple(a.dtype for a in tensors))
            kernel = self._static.get(key)
        if kernel is None:
            kernel = self._kernel(tensors, names, tree, lay, spec)
            if kernel is None:
                return None
            if tree.static_key is not None:
                self._static[key] = kernel
        out = kernel.boxed_run(tensors)  # takes the list and empties it
        self.passes += 1
        self.ema_passes += ema is not None
        committed, num, path, last_slot, last_token, n_fin, reason, hist_len = out[:8]
        verified = VerifyResult(committed, num, path, last_slot, last_token)
        if args.kv is None:
            rows.keep_path(block.tree, verified.path_slots)
        rows.advance(hist_len, last_token, reason)
        return Settled(verified, n_fin, reason, mask_hidden=out[-1] if hidden is not None else None,
                       ema_m=out[8] if ema is not None else None)

    def _kernel(self, args: list[torch.Tensor], names: tuple[str, ...], tree: DraftTree, lay: Any,
                spec: SettleSpec) -> Optional[Any]:
        """The kernel for this pass's shapes (compiled on first use), or None when there is none."""
        if not all(a.is_contiguous() for a in args):
            return None  # the kernel reads dense rows (never so for the engine's own buffers)
        # SHARED tensors are [1, ..] (one for every row) or [B, ..]. At batch 1 they are both: a per-row tree's
        # (static_key None: [B, ..] at every other batch) count as per-row, so that the batch's last row keeps the
        # kernel its batch used instead of compiling a second one
        by_name = dict(zip(names, args))
        alone = by_name["tokens"].shape[0] == 1 and tree.static_key is None
        per_row = {name: a.shape[0] != 1 or alone for name, a in by_name.items() if name in SettleArgs.SHARED}
        kv = args[-1] if names[-1] == "kv" else None
        optional = [by_name[n] for n in names[13:] if n != "kv"]
        key = (names, tree.num_slots, spec, tuple(a.dtype for a in args), tuple(per_row.values()),
               by_name["slot_logits"].shape[2],
               *(tuple(a.shape[1:]) for a in (lay.visible, lay.depth, by_name["stop_table"], *optional)),
               # (the EMA table's rows are dynamic: a kernel serves the table at every size)
               *(tuple(a.shape[1:] if name == "ema_cols" else a.shape) + (a.dtype,) for name, a in by_name.items()
                 if name in SettleArgs.FIXED),
               None if kv is None else (kv.shape[:2], kv.shape[3], kv.shape[5], kv.dtype))
        dynamic = [{0: "batch", 1: "length"} if name == "hist" else {2: "rows", 4: "slots"} if name == "kv"
                   else {0: "gaps"} if name == "ema_cols"  # a larger block grows the table: the same kernel reads it
                   else {} if name in SettleArgs.FIXED else {0: "batch"} if per_row.get(name, True) else {}
                   for name in names]
        return self.kernels.get(key, lambda: _Settle(names, spec), args, dynamic)
