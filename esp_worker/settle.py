"""`engine.compile_host=true` (CPU): a greedy pass's work after the forward as one compiled kernel.

After the block's forward a greedy pass verifies the tree, cuts each row at its stop ids and limits, writes the
committed tokens to the history and counts the pass: ~30 tensor operations on a few elements each, ~40% of
the host time of an ESP pass at batch 1 on a CPU (each eager operation costs 5-10 us of dispatch there, with
caches cold after the model). `settle` is that work as one function of tensors, made of the engine's own
helpers (`verify_greedy`, `apply_stops`, `write_history`, `count_pass`); `Settler` exports it and compiles it
with AOTInductor once per block shape (the batch and the history's length are dynamic, so a job compiles a
kernel per block size, not per step), and calls the kernel directly: the packaged model's own Python wrapper
(pytree flattening) costs more than the operations it replaces.

The kernel covers greedy rows without stop strings and without per-proposer counts (hybrid); other passes,
and any shape whose compilation fails (logged once), run the phases eagerly. Compiled kernels compute the
same integers as eager ones (argmax, comparisons, indexing: no float rounding), so output is unchanged.
Compile time (~10-15 s per kernel) is counted in `compile_s`. A C++ compiler is needed, as for
`torch.compile` on a CPU.
"""
from __future__ import annotations

import logging
import tempfile
import time
import warnings
from typing import Any, Optional

import torch

from .batch import Rows, count_by_proposer, count_pass, write_history
from .drafters import Block
from .model_io import ModelLoadError
from .stops import apply_stops
from .tree import DraftTree
from .verify import VerifyResult, verify_greedy

log = logging.getLogger(__name__)

# settle's inputs, in order (the last two only with per-proposer counts); `_SHARED` may be [1, ..] (one for
# every row) or [B, ..], the others have rows on dim 0; `hist` grows on dim 1
_ARGS = ("tokens", "parents", "valid", "ancestors", "depth", "slot_logits", "stop_table", "hist_len", "limit",
         "limit_code", "hist", "hists", "drafted", "source", "accepted_by")
_SHARED = ("ancestors", "depth", "source")


def settle(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor, ancestors: torch.Tensor,
           depth: torch.Tensor, slot_logits: torch.Tensor, stop_table: torch.Tensor, hist_len: torch.Tensor,
           limit: torch.Tensor, limit_code: torch.Tensor, hist: torch.Tensor, hists: torch.Tensor,
           drafted: torch.Tensor, source: Optional[torch.Tensor] = None, accepted_by: Optional[torch.Tensor] = None,
           *, static_key: Optional[tuple], max_depth: int, width: int) -> tuple[torch.Tensor, ...]:
    """Verify (greedy), stop, write the history and count, for a tree [B, T] and its slot logits [B, T, V].

    hist [B, H], hists [B, W * W], drafted [B] and accepted_by [B, P] (with source, `Rows.count`) are updated
    in place (H >= hist_len + max_depth + 1).
    Returns (committed [B, S], num_committed [B], path_slots [B, S], last_slot [B], last_token [B], n_fin [B],
    reason [B], hist_len + n_fin [B])."""
    tree = DraftTree(tokens, parents, valid, static_key=static_key)
    res = verify_greedy(tree, slot_logits, ancestors, depth, max_depth)
    n_fin, reason = apply_stops(res.committed, res.num_committed, stop_table, hist_len, limit, limit_code)
    write_history(hist, hist_len, res.committed)
    count_pass(hists, width, drafted, n_fin, res.num_committed, tree.num_drafted())
    if source is not None:
        count_by_proposer(accepted_by, source, res.path_slots, res.num_committed, n_fin)
    return (res.committed, res.num_committed, res.path_slots, res.last_slot, res.last_token, n_fin, reason,
            hist_len + n_fin)


class _Settle(torch.nn.Module):
    """settle with its host-known arguments fixed: what torch.export traces."""

    def __init__(self, static_key: Optional[tuple], max_depth: int, width: int):
        super().__init__()
        self.static_key, self.max_depth, self.width = static_key, max_depth, width

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return settle(*args, static_key=self.static_key, max_depth=self.max_depth, width=self.width)


class Settled:
    """A compiled settle's outputs: the verification, each row's tokens kept and finish reason, new lengths."""

    __slots__ = ("res", "n_fin", "reason", "hist_len")

    def __init__(self, out: list[torch.Tensor]):
        committed, num, path, last_slot, last_token, self.n_fin, self.reason, self.hist_len = out
        self.res = VerifyResult(committed, num, path, last_slot, last_token)


class Settler:
    """AOTInductor kernels of `settle`, one per (block shape, depth, counts width); see the module docstring."""

    def __init__(self, device: torch.device):
        if device.type != "cpu":
            raise ModelLoadError("engine.compile_host compiles the host work of a CPU run (on a GPU it is queued "
                                 "behind the model's kernels); set engine.compile_host=false")
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler
            get_cpp_compiler()
        except Exception as e:  # noqa: BLE001 - any failure means no usable compiler
            raise ModelLoadError(f"engine.compile_host needs a C++ compiler ({type(e).__name__}: {e}); install g++ "
                                 f"or set engine.compile_host=false") from None
        self._kernels: dict[tuple, Any] = {}  # key -> the package loader (None: compiling it failed)
        self._dir = tempfile.TemporaryDirectory(prefix="esp-settle-")
        self.compile_s = 0.0
        self.passes = 0  # decode passes settled by a kernel
        self._last: Optional[tuple] = None  # (layout, parents, (width, depth), kernel) of the last static-tree pass

    def __call__(self, rows: Rows, block: Block, slot_logits: torch.Tensor) -> Optional[Settled]:
        """The pass settled by the kernel of its shape, or None when the kernel does not cover it (the caller
        runs the phases eagerly)."""
        if rows.sampling or rows.has_stop_strings:
            return None
        s = block.max_depth + 1  # a bound on the tokens a row commits (host-known)
        rows.ensure_capacity(s)
        width = rows.count_width(s)
        tree, lay, t = block.tree, block.layout, rows.t
        args = [tree.tokens, tree.parents, tree.valid, lay.visible, lay.depth, slot_logits, t["stop_table"],
                t["hist_len"], t["limit"], t["limit_code"], t["hist"], t["hists"], t["drafted"]]
        if block.source is not None and "accepted_by" in t:  # per-proposer counts (hybrid)
            args += [block.source, t["accepted_by"]]
        last = self._last
        if (last is not None and last[0] is lay and last[1] is tree.parents and last[2] == (width, block.max_depth)
                and len(args) == 13 and tree.tokens.is_contiguous() and tree.valid.is_contiguous()):
            kernel = last[3]  # a static tree's pass like the last: its shared layout and parents, fresh tokens
        else:
            kernel = self._kernel(args, tree, lay, block.max_depth, width)
            if kernel is None:
                return None
            # the engine's own row tensors are dense; a static tree's layout and parents are built once
            self._last = (lay, tree.parents, (width, block.max_depth), kernel) if tree.static_key is not None else None
        out = kernel.boxed_run(args)  # takes the list and empties it
        self.passes += 1
        return Settled(out)

    def _kernel(self, args: list[torch.Tensor], tree: DraftTree, lay: Any, max_depth: int, width: int) -> Optional[Any]:
        """The kernel for this pass's shapes (compiled on first use), or None when there is none."""
        if not all(a.is_contiguous() for a in args):
            return None  # the kernel reads dense rows (never so for the engine's own buffers)
        # every size but the batch's and the history's: a kernel does not check its inputs' shapes (as eager ops
        # do). _SHARED tensors are [1, ..] or [B, ..]; at batch 1 either counts as shared
        per_row = tuple(a.shape[0] != 1 for a in args[3:5] + args[13:14])
        key = (tree.num_slots, tree.static_key, max_depth, width, per_row, args[5].shape[2],
               *(tuple(a.shape[1:]) for a in (lay.visible, lay.depth, args[6], *args[13:])))
        kernel = self._kernels.get(key, False)
        if kernel is False:
            kernel = self._kernels[key] = self._compile(key, args, tree.static_key, max_depth, width, per_row)
        return kernel

    def _compile(self, key: tuple, args: list[torch.Tensor], static_key: Optional[tuple], max_depth: int, width: int,
                 per_row: tuple[bool, ...]) -> Optional[Any]:
        t0 = time.perf_counter()
        batch = torch.export.Dim("batch", min=1)
        length = torch.export.Dim("length", min=2)
        try:
            with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations inside export
                warnings.simplefilter("ignore", DeprecationWarning)
                spec, examples = [], []
                for name, a in zip(_ARGS, args):
                    rows = name not in _SHARED or per_row[_SHARED.index(name)]
                    dims = {0: batch} if rows else {}
                    if name == "hist":
                        dims[1] = length
                    spec.append(dims or None)
                    # a batch of 2 to trace (a batch of 1 is specialised); clones: tracing leaves the rows alone
                    examples.append(a[:1].expand(2, *a.shape[1:]).clone() if rows else a.clone())
                program = torch.export.export(_Settle(static_key, max_depth, width), tuple(examples),
                                              dynamic_shapes=(tuple(spec),))
                path = torch._inductor.aoti_compile_and_package(
                    program, package_path=f"{self._dir.name}/settle-{len(self._kernels)}.pt2")
                kernel = torch._inductor.aoti_load_package(path).loader
        except Exception as e:  # noqa: BLE001 - an optimisation: the pass runs eagerly instead
            log.warning("engine.compile_host: no kernel for block shape %s (%s: %s); these passes run eagerly",
                        key, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            kernel = None
        self.compile_s += time.perf_counter() - t0
        return kernel
