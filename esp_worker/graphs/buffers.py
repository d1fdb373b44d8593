"""Typed static buffers of a captured decode pass: its shape class, its inputs and its outputs.

A CUDA graph replays kernels on fixed addresses, so every tensor a captured pass reads or writes lives in a
buffer made once per shape class: the engine copies a pass's inputs into `StepInputs` (rows 0 .. b-1 of a
batch bucket of B rows), the graph replays, and the results are read from the `StepOutput` the capture made.
Rows b .. B-1 are padding: their inputs are benign (length 1, token 0) and their outputs are never read or
committed. The KV slab (`kv_cache.KVCache.slab`) is the one buffer shared by every class.

Shapes: B rows (the bucket), T tree slots, A auxiliary inputs (ESP's masks), Q = T + A, S = max_depth + 1
tokens a row may commit, C key slots attention reads (the capacity bucket), D hidden size, V logits.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..logprobs import TokenLogprobs
from ..passes import ProbeOut

# the packed integer outputs, one row each (`StepOutput.ints`)
INTS = ("num_committed", "last_slot", "last_token", "n_fin", "reason")


@dataclass(frozen=True)
class ShapeClass:
    """The host-known shape of a pass: one captured graph serves every pass of its class."""

    batch: int  # B: rows, a bucket (1, 2, 4, ..); rows past the live batch are padding
    num_slots: int  # T: tree slots (root included)
    num_aux: int  # A: auxiliary inputs after the tree slots (ESP's masks)
    capacity: int  # C: key slots every row's attention reads (a capacity bucket of the slab)
    max_depth: int  # a bound on the accepted depth: a row commits at most S = max_depth + 1 tokens
    in_place: bool  # root-only trees and chains: the accepted path is already where it belongs in the cache
    shared_layout: bool  # one in-block layout for every row ([1, ..]), else one per row ([B, ..])
    sampling: bool  # some row samples (temperature > 0): sampled verification with the rows' uniforms
    # some row returns its tokens' log-probabilities: the pass computes them with this many alternatives
    # (`StepOutput.logprobs`); None = no row asks
    logprobs: Optional[int] = None
    # the drafter's work after the pass, run as the step's last stage (`graphs.hooks.StepHooks.step_probe`: ESP's and
    # the hybrid's probe, the hybrid's logit store; a hashable `drafters.esp.ProbeStage`); None = on the host
    probe: Optional[Any] = None

    @property
    def num_inputs(self) -> int:
        """Q: tokens fed per row."""
        return self.num_slots + self.num_aux

    @property
    def commit_width(self) -> int:
        """S: tokens a row may commit."""
        return self.max_depth + 1


@dataclass(frozen=True)
class ModelDims:
    """Sizes and types of the model's side of the buffers."""

    hidden: int  # D
    num_logits: int  # V: the LM head's outputs
    dtype: torch.dtype  # the model's dtype (auxiliary inputs, hidden states)
    device: torch.device


@dataclass
class StepInputs:
    """What one pass reads, rows 0 .. B-1 (the bucket). Written by `fill_*` before each replay, never replaced."""

    # [B, T] token of each tree slot (slot 0 = the root)
    tokens: torch.Tensor
    # [B, T] parent slot (-1 at the root)
    parents: torch.Tensor
    # [B, T] bool: False for padding nodes
    valid: torch.Tensor
    # [B, A, D] auxiliary input embeddings (ESP's masks); None when A = 0
    aux: Optional[torch.Tensor]
    # [L, Q, Q] bool in-block visibility, L = 1 (shared layout) or B
    visible: torch.Tensor
    # [L, Q] position of each input relative to the root
    rel_pos: torch.Tensor
    # [L, T] depth of each tree slot
    depth: torch.Tensor
    # [B] tokens of each row (prompt + committed, the root included: its cache holds hist_len - 1 slots)
    hist_len: torch.Tensor
    # [B, V] bool: token ids that stop each row
    stop_table: torch.Tensor
    # [B] most tokens each row may hold, and the finish reason when it gets there
    limit: torch.Tensor
    limit_code: torch.Tensor
    # [B] sampling parameters (sampled classes only)
    temperature: Optional[torch.Tensor] = None
    top_p: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    # [B, S] each row's next S uniforms, one per token it may commit (sampled classes only)
    uniforms: Optional[torch.Tensor] = None
    # [C] the key slots every row's attention reads, 0 .. C-1: the step takes the class's capacity from its
    # length, a tensor size that a compiled step can hold symbolic (`mark_dynamic`), not a Python int it would
    # compile anew for each capacity bucket
    key_slots: Optional[torch.Tensor] = None
    # [B, 1, D] float32 the rows' mask vector before the pass (classes with a probe stage)
    m: Optional[torch.Tensor] = None
    # [S + 1, 1, 1 + S] the EMA's weights by kept tokens (a probe stage with the EMA on; constant per class)
    ema_cols: Optional[torch.Tensor] = None
    # [B, T] each tree slot's index among the mask owners, -1 = no masks (a stage whose masks hang on some slots)
    mask_owner: Optional[torch.Tensor] = None

    @classmethod
    def allocate(cls, shape: ShapeClass, dims: ModelDims) -> "StepInputs":
        """Buffers of a class, every row benign padding (length 1, token 0, the root valid and seeing itself)."""
        b, t, a, q, s = shape.batch, shape.num_slots, shape.num_aux, shape.num_inputs, shape.commit_width
        lay = 1 if shape.shared_layout else b
        dev = dims.device
        zeros = lambda *size, dtype=torch.long: torch.zeros(size, dtype=dtype, device=dev)  # noqa: E731
        sampled, stage = shape.sampling, shape.probe
        inp = cls(
            tokens=zeros(b, t), parents=zeros(b, t), valid=zeros(b, t, dtype=torch.bool),
            aux=zeros(b, a, dims.hidden, dtype=dims.dtype) if a else None,
            visible=torch.eye(q, dtype=torch.bool, device=dev).expand(lay, q, q).contiguous(),
            rel_pos=zeros(lay, q), depth=zeros(lay, t), hist_len=torch.ones(b, dtype=torch.long, device=dev),
            stop_table=zeros(b, dims.num_logits, dtype=torch.bool),
            limit=torch.full((b,), 1 << 30, dtype=torch.long, device=dev), limit_code=zeros(b),
            temperature=zeros(b, dtype=torch.float32) if sampled else None,
            top_p=torch.ones(b, device=dev) if sampled else None,
            top_k=zeros(b) if sampled else None,
            uniforms=zeros(b, s, dtype=torch.float32) if sampled else None,
            key_slots=torch.arange(shape.capacity, device=dev),
            m=zeros(b, 1, dims.hidden, dtype=torch.float32) if stage is not None and stage.probe is not None else None,
            ema_cols=stage.ema_columns(s, dev) if stage is not None and stage.ema else None,
            mask_owner=torch.full((b, t), -1, dtype=torch.long, device=dev) if stage is not None and stage.owners
            else None,
        )
        inp.parents.fill_(-1)
        inp.valid[:, 0] = True
        return inp

    def mark_dynamic(self) -> None:
        """Tell torch.compile (`engine.cuda_graphs_compile`) that the batch and the capacity vary between classes,
        so that one compile serves every batch bucket of two or more rows at every capacity bucket. Otherwise it
        compiles first for the sizes it meets and again each time one of them changes (in a CPU run of 23 rows at
        batch 16, five compiles of the plain pass against three; each takes tens of seconds on a GPU). A bucket of
        one row still compiles apart (torch specialises sizes of one), as does the slab's whole row (that view of
        it is contiguous)."""
        batch = self.hist_len.shape[0]
        for f in dataclasses.fields(self):
            t = getattr(self, f.name)
            if t is not None and batch > 1 and t.shape[0] == batch and f.name != "ema_cols":  # rows first
                torch._dynamo.maybe_mark_dynamic(t, 0)
        torch._dynamo.maybe_mark_dynamic(self.key_slots, 0)

    def clear_rows(self, start: int) -> None:
        """Rows start .. B-1 become padding again (after the live batch shrank): length 1, never stopping, so a
        stale row can neither write past its bucket's slots nor read another row's."""
        self.hist_len.narrow(0, start, self.hist_len.shape[0] - start).fill_(1)
        self.tokens.narrow(0, start, self.tokens.shape[0] - start).zero_()


@dataclass
class StepOutput:
    """What one pass produces, rows 0 .. B-1. In a captured graph these are the capture's own tensors, written
    anew by every replay: readers take what they need before the next pass."""

    # [B, Q, D] hidden states of every input (after the final norm). The logits are not kept: [B, T, V] per class
    # would hold gigabytes (the engine computes them from these for a drafter that reads them)
    hidden: torch.Tensor
    # [B, S] committed tokens (accepted drafts then the bonus), valid up to num_committed
    committed: torch.Tensor
    # [B, S] tree slots on the accepted path (slot 0 first)
    path_slots: torch.Tensor
    # [5, B] `INTS`: tokens committed before the stops, deepest accepted slot, last committed token, tokens kept
    # after the stops, finish reason
    ints: torch.Tensor
    # the probe stage's results (classes with one): the drafter's next candidates and tree
    probe: Optional[ProbeOut] = None
    # the committed tokens' log-probabilities (classes with `logprobs`; `logprobs.path_logprobs`)
    logprobs: Optional[TokenLogprobs] = None

    def copy_(self, other: "StepOutput") -> "StepOutput":
        """Write `other` into these buffers (the eager static path keeps a graph's semantics: one set of output
        buffers per class, overwritten by every pass)."""
        for name in ("hidden", "committed", "path_slots", "ints"):
            getattr(self, name).copy_(getattr(other, name))
        for part in ("probe", "logprobs"):
            if getattr(self, part) is not None:
                for mine, theirs in zip(getattr(self, part).tensors(), getattr(other, part).tensors()):
                    if mine is not None:
                        mine.copy_(theirs)
        return self

    def clone(self) -> "StepOutput":
        return StepOutput(self.hidden.clone(), self.committed.clone(), self.path_slots.clone(), self.ints.clone(),
                          None if self.probe is None else self.probe.map(torch.Tensor.clone),
                          None if self.logprobs is None else self.logprobs.map(torch.Tensor.clone))
