"""`dmtd_verified`: a trained copy of the model's last D layers drafts tau - 1 tokens per pass from the trunk's
states (DMTD's decoding passes), and the model verifies them as every draft is verified: the output is exactly
the model's (lossless).

The copy is trained by `esp-batch train-dmtd dmtd.verified=true`: the model frozen, the copy in the decoding
layers' place of the cyclic forward (model/dmtd.py), so at a cycle start it reads the trunk's output (the hidden
states entering layer L - D) and elsewhere the token's embedding only (E = 0). It keeps its own keys and values
per row (`dkv`), one slot per position, the inputs of the same form:

    slot s:  emb(x_s) + trunk(s)   where s was a cycle start: a prompt position s % tau == 0, or the last
                                   accepted slot of a decode pass
             emb(x_s)              elsewhere

A pass with root x_t at position t (its last accepted slot was p = t - 1, whose trunk state the verification gave)
feeds [x_p (with trunk(p)), x_t] to the copy, then each draft it chose: tau - 1 forwards of D layers that write
slots p .. t + tau - 2 and give the drafts d_1 .. d_{tau-1} (greedy), a chain the model verifies. Accepted
drafts' slots already hold their tokens' keys (the same token, the same input); the next pass rewrites its p as a
cycle start. With every draft accepted the starts fall tau apart, as in training.

State per row: `dkv` [B, D, 2, Hkv, C, hd] the copy's keys and values (C slots); `think` [B, Dm] trunk(p).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..consts import ones, steps
from ..grad import inference
from ..kv_cache import bucket
from ..model.attention import attention_bias
from ..model.decoder import direct_decoder
from ..model.dmtd import DmtdConfig, DmtdConfigError, load_draft
from ..model.layers import ModuleLayers
from ..passes import Block, PassPlan, PassRecord, RowsView
from ..row_state import RowState, row_field
from ..tree import DraftTree
from .base import FULL, Drafter


@dataclass
class DmtdVerifiedState(RowState):
    dkv: Optional[torch.Tensor] = row_field()  # [B, D, 2, Hkv, C, hd] the copy's keys and values
    think: Optional[torch.Tensor] = row_field()  # [B, Dm] the trunk's output at the last cycle start


class DraftStack(torch.nn.Module):
    """The copy as a decoder the direct loop (or the modules' loop) runs: its layers, the model's final norm and
    rotary embedding, the model's config."""

    def __init__(self, base: Any, layers: torch.nn.ModuleList):
        super().__init__()
        self.layers, self.norm, self.rotary_emb = layers, base.norm, base.rotary_emb
        self.config = base.config
        for j, layer in enumerate(layers):  # the copy's own cache indices 0 .. D-1
            layer.self_attn.layer_idx = j


class _SlotCache:
    """The copy's keys and values of the rows as the layers' cache: a forward writes Q slots per row from `write_at`
    (an int, or [B] per row) and sees slots 0 .. view_len-1. The `update` contract of kv_cache.KVCache's layers."""

    def __init__(self, dkv: torch.Tensor, write_at: Any, view_len: int):
        self.dkv, self.write_at, self.view_len = dkv, write_at, view_len

    def update(self, ks: torch.Tensor, vs: torch.Tensor, layer: int, *args: Any, **kwargs: Any):
        # ks, vs: [B, Hkv, Q, hd] -> keys, values [B, Hkv, S, hd] (views)
        k, v = self.dkv[:, layer, 0], self.dkv[:, layer, 1]
        q = ks.shape[2]
        if isinstance(self.write_at, int):
            k[:, :, self.write_at: self.write_at + q] = ks
            v[:, :, self.write_at: self.write_at + q] = vs
        else:
            idx = (self.write_at[:, None] + steps(q, ks.device)[None])[:, None, :, None].expand(ks.shape)
            k.scatter_(2, idx, ks)
            v.scatter_(2, idx, vs)
        return k[:, :, : self.view_len], v[:, :, : self.view_len]


class DmtdVerifiedDrafter(Drafter):
    name = "dmtd_verified"
    state_type = DmtdVerifiedState

    def __init__(self, runner: Any, path: str, tau: int = 0):
        super().__init__()
        model = runner.model
        layers, cfg = load_draft(path, model)
        if cfg.num_encoding_layers:
            raise DmtdConfigError(f"engine.dmtd_path={path!r}: dmtd_verified drafts from the trunk's output with E = 0; "
                                  f"this copy has num_encoding_layers={cfg.num_encoding_layers}")
        self.cfg: DmtdConfig = cfg.with_overrides(tau=tau)
        self.depth = self.cfg.tau - 1  # drafts per pass
        if self.depth < 1:
            raise DmtdConfigError("dmtd_verified needs tau >= 2 (engine.dmtd_tau)")
        self.runner = runner
        runner.tap_layer = self.cfg.thinking_end  # every forward keeps the trunk's output for observe
        stack = DraftStack(runner.base, layers)
        self.num_layers = len(layers)
        self.stack = (direct_decoder(stack) if runner.direct is not None else None) or ModuleLayers(stack)
        attn = layers[0].self_attn
        self.kv_shape = (len(layers), 2, attn.config.num_key_value_heads, attn.head_dim)
        self._parents: dict[tuple, torch.Tensor] = {}

    # ---- rows --------------------------------------------------------------------------------------------
    def start_rows(self, view: RowsView) -> None:
        b, dev = view.hist.shape[0], view.hist.device
        d, two, h, hd = self.kv_shape
        view.state.dkv = torch.zeros((b, d, two, h, self._capacity(view), hd), dtype=self.runner.dtype, device=dev)
        view.state.think = torch.zeros((b, self.runner.embed.weight.shape[1]), dtype=self.runner.dtype, device=dev)
        return None

    def _capacity(self, view: RowsView) -> int:
        """Slots the copy needs: the longest row, the drafts after it and a margin (grown in 1/8 steps)."""
        return bucket(max(view.lens) + self.cfg.tau + 1)

    def _grow(self, view: RowsView) -> None:
        st = view.state
        need = max(view.lens) + self.cfg.tau
        if st.dkv.shape[4] < need:
            st.dkv = torch.nn.functional.pad(st.dkv, (0, 0, 0, self._capacity(view) - st.dkv.shape[4]))

    @inference
    def observe(self, view: RowsView, record: PassRecord) -> None:
        """The trunk's output at the last accepted slot (the next pass's cycle start); after the prefill, the
        copy's keys and values of the prompt (cycle starts at positions % tau == 0, as in training)."""
        trunk = record.trunk
        if trunk is None:
            raise RuntimeError("dmtd_verified needs the trunk's states of every pass (runner.tap_layer)")
        st = view.state
        if record.prefill:
            last = view.prompt_len - 1  # [R] the last prompt token: the first pass's cycle start
            st.think = trunk.gather(1, last[:, None, None].expand(-1, 1, trunk.shape[-1]))[:, 0]
            self._prompt(view, trunk)
            return
        st.think = trunk.gather(1, record.last_slot[:, None, None].expand(-1, 1, trunk.shape[-1]))[:, 0]

    def _prompt(self, view: RowsView, trunk: torch.Tensor) -> None:
        """The copy over every prompt position (padding past a prompt writes slots past its length: stale)."""
        b, q = trunk.shape[:2]
        dev = trunk.device
        pos = steps(q, dev)[None].expand(b, q)
        start = (pos % self.cfg.tau == 0)[..., None].to(trunk.dtype)
        x = self.runner.embed_ids(view.hist[:, :q]) + trunk * start
        i = steps(q, dev)
        bias = attention_bias((i[:, None] >= i[None, :])[None], None, pos, q, self.runner.dtype,
                              self.runner.sliding_window)
        self._run(x, pos, bias, _SlotCache(view.state.dkv, 0, q))

    def _run(self, x: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, cache: _SlotCache) -> torch.Tensor:
        with self.runner.timing("dmtd_verified.draft"):
            rope = self.stack.rope(x, pos, None)
            return self.stack.norm(self.stack.run(x, 0, self.num_layers, rope, bias, cache))

    # ---- a pass ------------------------------------------------------------------------------------------
    @inference
    def propose(self, view: RowsView, plan: PassPlan = FULL) -> Block:
        """The root and tau - 1 greedy drafts of the copy, as a chain."""
        if plan.num_nodes is not None and plan.num_nodes <= 0:
            return self.blocks.build(DraftTree.root_only(view.root), max_depth=0)
        self._grow(view)
        st, runner = view.state, self.runner
        b, dev = view.hist.shape[0], view.hist.device
        lens = view.lens
        one = min(lens) == max(lens)  # rows of one length: slots from the host
        root = view.root
        p_tok = view.hist.gather(1, (view.hist_len - 2)[:, None])[:, 0]  # [B] x_p, the last cycle start's token
        x = torch.stack([runner.embed_ids(p_tok) + st.think, runner.embed_ids(root)], 1)  # [B, 2, Dm]
        first = view.hist_len - 2  # [B] slot of p
        drafts = []
        for i in range(self.depth):
            q = x.shape[1]
            start = (lens[0] - 2 + (0 if i == 0 else i + 1)) if one else None  # the block's first slot, host
            slot0 = first if i == 0 else first + (i + 1)  # [B]: p, then t + i
            pos = slot0[:, None] + steps(q, dev)[None]  # [B, Q]
            view_len = max(lens) + i  # slots through this block's last
            in_block = (steps(q, dev)[:, None] >= steps(q, dev)[None, :])[None]
            bias = attention_bias(in_block, slot0, pos, view_len, runner.dtype, runner.sliding_window)
            h = self._run(x, pos, bias, _SlotCache(st.dkv, start if one else slot0, view_len))
            tok = runner.logits(h[:, -1]).argmax(-1)  # [B] the copy's greedy next token
            drafts.append(tok)
            x = runner.embed_ids(tok)[:, None]
        chain = torch.stack(drafts, 1)  # [B, tau - 1]
        tokens = torch.cat([root[:, None], chain], 1)
        key = (b, self.depth, dev)
        if key not in self._parents:
            self._parents[key] = torch.arange(-1, self.depth, device=dev).expand(b, -1).contiguous()
        tree = DraftTree(tokens=tokens, parents=self._parents[key], valid=ones((b, self.depth + 1), torch.bool, dev),
                         static_key=("chain", self.depth))
        return self.blocks.build(tree, max_depth=self.depth)
