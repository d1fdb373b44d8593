"""The device work of one decode pass as a pure function of static buffers: what a CUDA graph captures.

    decode_step(model, kv, inp, shape) -> StepOutput

1. input embeddings of [root, draft nodes], then the auxiliary inputs (ESP's masks);
2. positions (each row's cached length + the layout's relative positions) and the additive attention bias over
   the class's C key slots, from the rows' lengths and the in-block visibility (`attention_bias`);
3. every layer (`DirectDecoder.run`), its keys and values written into the KV slab at each row's slots;
4. the LM head at the tree slots;
5. the settle: verification (greedy, or sampled with each row's next uniforms), stops (stop ids, limits), and the
   accepted nodes' KV slots moved behind each row's root; in classes where some row asks for them, the committed
   tokens' log-probabilities;
6. in classes with a probe stage (`ShapeClass.probe`: ESP, `graphs/hooks.py`), the drafter's probe: the mask EMA,
   the candidates of the last accepted slot's masks and the next static tree.

No Python branch on a tensor's value, no shape that depends on one, no host read: the same calls run eagerly,
under `torch.compile(fullgraph=True)` and inside a CUDA graph capture. The step is made of the eager pass's own
functions, so its tokens are the eager pass's. Its attention reads the class's C key slots (masked past each row's
length) where the eager pass reads max(length) + Q: the same keys, but a different count can make a kernel add
in another order, so floats agree to rounding and are bitwise equal where both read the same count.

What it leaves to the host, after the replay (`graphs/runner.py`): the history write and the statistics counters
(their tensors belong to the rows and change shape as rows come and go), and the drafter's observe (for ESP, taking
the probe stage's results). Its outputs
hold no logits ([B, T, V] per class would hold gigabytes): the logits are an intermediate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..consts import steps
from ..kv_cache import move_slots
from ..logprobs import path_logprobs
from ..model.attention import attention_bias
from ..model.decoder import DirectDecoder, RopeTable
from ..model.flex import flex_mask
from ..model.runner import ModelRunner
from ..sampling import choose_tokens
from ..stops import apply_stops
from ..tree import DraftTree
from ..verify import verify, verify_greedy
from .buffers import ShapeClass, StepInputs, StepOutput


@dataclass
class StepModel:
    """What the step reads of the model: the direct decoder's layers, the embedding, the LM head and a rotary table
    held here (a table the eager forward later grows is a new tensor; a captured graph keeps reading this one)."""

    decoder: DirectDecoder
    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [..] -> [.., D]
    head: Callable[[torch.Tensor], torch.Tensor]  # hidden [.., D] -> float32 logits [.., V]
    rope: RopeTable  # rotary table of positions 0 .. P-1
    max_position: int  # the model's last position: later ones are clamped to it, as the eager pass does
    window: Optional[int]  # sliding attention window (None = full attention)
    dtype: torch.dtype

    @property
    def flex(self) -> bool:
        """Attention through FlexAttention's block mask (engine.attention_backend=flex; not with a sliding window,
        whose models keep SDPA's bias)."""
        return self.decoder.attention_backend == "flex" and self.window is None

    @property
    def dynamic_shapes(self) -> bool:
        """A compiled step holds the batch and the capacity symbolic (`compiled_step`). Not under flex: Inductor's
        FlexAttention template for the CPU, which the suite compiles, emits C++ that does not build once a size is
        symbolic (torch 2.13), so there each class compiles with its own sizes, the form the suite checks."""
        return not self.flex

    @classmethod
    def of(cls, runner: ModelRunner, positions: int) -> "StepModel":
        """The runner's model for passes whose positions stay below `positions` (`graph_support` said yes)."""
        dec = runner.direct
        rope = _table(dec, positions, runner.loaded.max_context - 1, runner.dtype, runner.device)
        return cls(dec, runner._embed_fn, runner.head, rope, runner.loaded.max_context - 1, runner.sliding_window,
                   runner.dtype)

    def covering(self, positions: int) -> "StepModel":
        """This model with a rotary table for positions below `positions` (after the KV slab grew)."""
        if self.rope.cos.shape[0] >= min(positions, self.max_position + 1):
            return self
        rope = _table(self.decoder, positions, self.max_position, self.dtype, self.rope.cos.device)
        return dataclasses.replace(self, rope=rope)


def _table(dec: DirectDecoder, positions: int, max_position: int, dtype: torch.dtype, device) -> RopeTable:
    """The decoder's rotary table covering positions below min(positions, max_position + 1)."""
    like = torch.zeros((1, 1, 1), dtype=dtype, device=device)
    return dec.rotary_table(min(positions - 1, max_position), like)


def graph_support(runner: ModelRunner) -> Optional[str]:
    """Why this model's passes cannot be captured (None: they can)."""
    if runner.direct is None:
        return ("the model runs its own forward (model.direct_forward=false, or an architecture other than Llama, "
                "Mistral, Qwen2 and Qwen3 with sdpa or eager attention)")
    if not runner.direct.rope_table:
        return "its rotary embedding depends on the sequence length"
    if runner._embed_fn is None or runner._head_fn is None:
        return "its input embedding or LM head is not a plain lookup / linear layer"
    if runner.tap_layer is not None:
        return "a drafter reads hidden states inside the model (runner.tap_layer: dmtd_verified)"
    if runner.direct.compiled is not None:
        return "engine.compile=true compiles the eager passes' layers instead (choose one)"
    return None


StepFn = Callable[["StepModel", torch.Tensor, StepInputs, ShapeClass], StepOutput]  # decode_step's signature


def compiled_step(model: StepModel, mode: str = "", recompile_limit: int = 512) -> StepFn:
    """`decode_step` under Inductor (engine.cuda_graphs_compile): the step is one graph with no break (tested), so
    what a CUDA graph then captures is Inductor's fused kernels instead of one kernel per operation. The batch and
    the capacity are dynamic from the first compile (`StepInputs.mark_dynamic`), so one compile of a block serves
    every batch bucket of two or more rows at every capacity bucket; a batch of one row, and a capacity of the
    slab's whole row, compile apart (torch specialises sizes of one, and that view is contiguous). Under
    engine.attention_backend=flex every class compiles apart (`StepModel.dynamic_shapes`).
    Each shape class still gets its own CUDA graph. recompile_limit: compiles kept before torch falls back to
    eager for new shapes (torch's default, 8, is fewer than the classes a drafting job meets)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, recompile_limit)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, recompile_limit)
    return torch.compile(decode_step, fullgraph=True, dynamic=None if model.dynamic_shapes else False,
                         mode=mode or None)


class StaticCache:
    """The KV slab as the decoder's cache inside the step: layer i writes row b's Q new keys and values at slots
    cache_len[b] .. cache_len[b] + Q - 1 and hands attention slots 0 .. C - 1 of the batch's rows.

    The write is one index_put on the slab itself, not a scatter into a view of it: under torch.compile a write
    through views of a graph input becomes a chain of whole-slab scatters that Inductor does not turn back into
    an in-place write (a compiled pass then copied the slab per layer, its time growing with the slab)."""

    def __init__(self, kv: torch.Tensor, cache_len: torch.Tensor, num_inputs: int, capacity: int):
        # kv: [L, 2, R, H, Cs, D] the slab (R >= B rows, Cs >= C slots); cache_len: [B]
        self.kv, self.capacity, self.rows = kv, capacity, cache_len.shape[0]
        dev = cache_len.device
        self.layer_ids = steps(kv.shape[0], dev)  # [L]
        self.row_ids = steps(self.rows, dev).unsqueeze(1)  # [B, 1]
        self.slots = cache_len.unsqueeze(1)  # [B, Q]: each row's Q slots from its cached length
        if num_inputs > 1:
            self.slots = self.slots + steps(num_inputs, dev)

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        # keys, values: [B, Hkv, Q, hd] -> the first C slots of the rows' buffers [B, Hkv, C, hd] each
        kv = torch.stack([keys, values]).permute(1, 3, 0, 2, 4)  # [B, Q, 2, Hkv, hd]: the index's dims first
        self.kv[self.layer_ids.narrow(0, layer, 1), :, self.row_ids, :, self.slots] = kv  # a [1] index: no item()
        k = self.kv[layer, 0].narrow(0, 0, self.rows)
        v = self.kv[layer, 1].narrow(0, 0, self.rows)
        return k.narrow(2, 0, self.capacity), v.narrow(2, 0, self.capacity)


class _SampledChoice:
    """verify's `choose` over the static uniforms: its j-th call takes every row's j-th uniform (a row consumes one
    per committed token, in order, exactly as `UniformStreams.take` hands them out eagerly)."""

    def __init__(self, inp: StepInputs):
        self.inp, self.j = inp, 0

    def __call__(self, logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        inp = self.inp
        u = inp.uniforms.select(1, self.j)  # [B]
        self.j += 1
        return choose_tokens(logits, inp.temperature, inp.top_p, inp.top_k, u)


def decode_step(model: StepModel, kv: torch.Tensor, inp: StepInputs, shape: ShapeClass) -> StepOutput:
    """One decode pass over the class's B rows (see the module docstring); writes the KV slab in place."""
    t, q = shape.num_slots, shape.num_inputs
    capacity = inp.key_slots.shape[0]  # C (shape.capacity): a tensor size, symbolic in a compiled step
    embeds = model.embed(inp.tokens)  # [B, T, D]
    if inp.aux is not None:
        embeds = torch.cat([embeds, inp.aux], 1)  # [B, Q, D]
    cache_len = inp.hist_len - 1  # [B] cached slots per row (the root is not cached yet)
    pos = (cache_len.unsqueeze(1) + inp.rel_pos).clamp(max=model.max_position)  # [B, Q]
    if model.flex:  # the same visibility as a block mask (model/flex.py)
        bias = flex_mask(inp.hist_len, inp.visible, q, capacity)
    else:
        bias = attention_bias(inp.visible, cache_len, pos, capacity, model.dtype, model.window,  # [B, 1, Q, C]
                              slots=inp.key_slots)
    dec = model.decoder
    rope = dec.rope_at(model.rope, pos)
    layers = dec.run(embeds, 0, len(dec.base.layers), rope, bias, StaticCache(kv, cache_len, q, capacity))
    hidden = dec.norm(layers)  # [B, Q, D]
    logits = model.head(hidden.narrow(1, 0, t))  # [B, T, V]

    tree = DraftTree(inp.tokens, inp.parents, inp.valid,
                     static_key=(("root",) if t == 1 else ("chain",)) if shape.in_place else None)
    if shape.sampling:
        res = verify(tree, logits, shape.max_depth, _SampledChoice(inp))
    else:
        res = verify_greedy(tree, logits, inp.visible, inp.depth, shape.max_depth)
    n_fin, reason = apply_stops(res.committed, res.num_committed, inp.stop_table, inp.hist_len, inp.limit,
                                inp.limit_code)
    p = res.path_slots.shape[1] - 1  # path steps after the root
    if not shape.in_place and p > 0:  # the accepted nodes move right behind each row's root
        length = inp.hist_len.unsqueeze(1)  # [B, 1] the root's slot + 1
        move_slots(kv, 2, length + steps(p, length.device), res.path_slots.narrow(1, 1, p) + (length - 1))
    last_token = res.last_token
    if last_token is None:  # sampled: the last committed token
        last_token = res.committed.gather(1, (res.num_committed - 1).unsqueeze(1)).squeeze(1)
    ints = torch.stack([res.num_committed, res.last_slot, last_token, n_fin, reason])  # [5, B]
    probe = None if shape.probe is None else shape.probe.run(model, inp, hidden, logits, res, last_token, n_fin)
    logprobs = None if shape.logprobs is None else path_logprobs(logits, res.path_slots, res.committed, shape.logprobs)
    return StepOutput(hidden=hidden, committed=res.committed, path_slots=res.path_slots, ints=ints, probe=probe,
                      logprobs=logprobs)
