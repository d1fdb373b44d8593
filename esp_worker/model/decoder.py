"""A direct forward over the decoder layers of Llama-family models (Llama, Mistral, Qwen2, Qwen3).

transformers' `LlamaModel.forward` (and Mistral's, Qwen2's, Qwen3's) wraps its layer loop in output capture,
config-default merging, mask creation and per-layer keyword plumbing. On a small model that wrapping is a
large share of a decode pass (about 0.5 ms of 4.4 ms per pass for `esp-tiny-llama` on one CPU thread).
`DirectDecoder` calls the model's own modules (norms, projections, rotary embedding, MLP) in the same order
with the same attention function, so its hidden states are bitwise equal to the model's forward; the tests
check that on every supported architecture. Any other architecture, attention implementation or layer shape
falls back to the model's forward (`direct_decoder` returns None).

Three things make it cheaper than the module calls it replaces, each bitwise equal on CPU in float32 (the
tests check the result, not just the parts):
- q/k/v and gate/up projections run as one product each: their weights (and biases) are moved into one
  buffer per layer and the modules' own parameters become views of it, so memory is unchanged and the model's
  forward still works;
- RMSNorm runs as the fused `F.rms_norm` where a check at start-up shows it equal to the module (in a half
  type: the weight applied after `F.rms_norm` rounds, the module's order of operations; `_norm_fn`);
- rotary cos/sin come from a table indexed by position (built with the model's own rotary module, grown on
  demand, rotate_half's sign folded into its sine), not recomputed per pass; rotary types that depend on the
  sequence length keep the module.
"""
from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..grad import inference
from ..tree import gather_slots
from .flex import FlexMask

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
FEW_ROWS = 8  # weight-major products pay up to this many rows on the CPU (`weight_major_linear`)
MIN_ROWS = 4  # products with fewer rows may take another kernel (e.g. a matrix-vector one) and round differently


@dataclass(frozen=True)
class RopeTable:
    """Rotary cos/sin by position, and the sine the fast rotary multiplies by (made once per table, not per pass)."""

    cos: torch.Tensor  # [P, hd]
    sin: torch.Tensor  # [P, hd] the module's
    signed_sin: torch.Tensor  # [P, hd] sin with rotate_half's sign carried (`_signed_sin`)


def direct_decoder(base: Any) -> Optional["DirectDecoder"]:
    """A DirectDecoder for `base` (the model's decoder, e.g. LlamaModel), or None where it does not apply."""
    cfg = base.config
    if getattr(cfg, "model_type", None) not in SUPPORTED or cfg._attn_implementation not in ("sdpa", "eager"):
        return None
    if not all(hasattr(base, a) for a in ("layers", "norm", "rotary_emb")):
        return None
    for layer in base.layers:
        if not all(hasattr(layer, a) for a in _LAYER_PARTS) or not all(hasattr(layer.self_attn, a) for a in _ATTN_PARTS):
            return None
        if not all(hasattr(layer.mlp, a) for a in _MLP_PARTS):
            return None
    modules = list(base.modules())
    if any(m._forward_hooks or m._forward_pre_hooks for m in modules):
        return None  # e.g. accelerate's offloading hooks: only the model's own forward runs them
    if not all(type(m).forward is torch.nn.Linear.forward for m in modules if isinstance(m, torch.nn.Linear)):
        return None  # quantised or adapter linears compute something else
    return DirectDecoder(base)


class DirectDecoder:
    """hidden [B, Q, D] = norm(layers(inputs_embeds)) with the caller's additive bias and positions."""

    def __init__(self, base: Any):
        self.base = base
        attn = base.layers[0].self_attn
        modeling = sys.modules[type(attn).__module__]  # the architecture's own rotary and eager attention
        self.rotate: Callable = modeling.apply_rotary_pos_emb
        self.sdpa = base.config._attn_implementation == "sdpa"  # bias None with Q > 1 = causal (is_causal)
        self.attention_backend = "torch"  # engine.attention_backend (`use_attention`)
        if not self.sdpa:
            self.attend: Callable = modeling.eager_attention_forward
        else:
            self.attend = sdpa_packed_gqa
        self.qk_norm = hasattr(attn, "q_norm") and hasattr(attn, "k_norm")  # Qwen3
        self.qkv = [_Fused(layer.self_attn, ("q_proj", "k_proj", "v_proj")) for layer in base.layers]
        self.parts = [_LayerParts.of(layer) for layer in base.layers]
        self.gate_up = [_Fused(layer.mlp, ("gate_proj", "up_proj")) for layer in base.layers]
        self.norm = _norm_fn(base.norm)
        # per layer: input norm, post-attention norm, and Qwen3's q / k norms
        self.norms = [
            (_norm_fn(layer.input_layernorm), _norm_fn(layer.post_attention_layernorm),
             _norm_fn(layer.self_attn.q_norm) if self.qk_norm else None,
             _norm_fn(layer.self_attn.k_norm) if self.qk_norm else None)
            for layer in base.layers
        ]
        rot = base.rotary_emb
        self.rope_table = getattr(rot, "rope_type", "default") not in ("dynamic", "longrope")
        self.heads = (attn.config.num_attention_heads, attn.config.num_key_value_heads)
        self.fast_rope = self._fast_rope_matches()
        self._table: Optional[RopeTable] = None  # grown on demand (`rotary_table`)
        self.compiled: Optional[Any] = None  # compiled.CompiledLayers under engine.compile
        self.linear: Callable = _linear  # (x, layer with .weight / .bias) -> x's product; see `few_rows`
        self.rows_invariant = self._rows_invariant()  # `keep` may skip rows of the last layer's products

    def use_attention(self, backend: str) -> None:
        """Decode passes' SDPA kernels (engine.attention_backend), under sdpa attention. `flex` is the compiled
        replayed passes' (graphs/step.py builds their `FlexMask`); eager passes keep torch's choice there."""
        self.attention_backend = backend
        if self.sdpa:
            self.attend = functools.partial(sdpa_packed_gqa, backends=attention_backends(backend))

    def pack(self, bias: Any, q: int) -> Any:
        """The layers' bias for a block of q inputs: under sdpa attention with grouped-query heads, a tensor bias as
        the `PackedBias` every layer's `_sdpa_packed_gqa` takes (one tiling per forward; per layer it is one more
        kernel, of a replayed pass's few hundred); anything else (None, a `FlexMask`, packed already) as given."""
        if not (self.sdpa and isinstance(bias, torch.Tensor)):
            return bias
        nq, nk = self.heads
        hd = self.base.layers[0].self_attn.head_dim
        return PackedBias(pack_bias(bias, nq // nk)) if packs(nq, nk, q, hd) else bias

    def few_rows(self) -> "DirectDecoder":
        """This decoder with its products computed as `weight_major_linear` (CPU, eager loop): for DMTD's
        refill, a product over tau rows of a lossy method. Not bitwise `F.linear`, so never for a pass whose
        tokens must equal the model's. Elsewhere (CUDA, compiled layers) the decoder itself."""
        if self.compiled is not None or self.base.layers[0].self_attn.o_proj.weight.device.type != "cpu":
            return self
        view = copy.copy(self)
        view.linear = weight_major_linear
        return view

    def compile(self, mode: Optional[str] = None) -> None:
        """Run the layers' projections, norms, rotary and MLP as compiled graphs (engine.compile)."""
        from .compiled import CompiledLayers

        self.compiled = CompiledLayers(self, mode)

    def _fast_rope_matches(self) -> bool:
        """`_rope` on a probe is bitwise the architecture's apply_rotary_pos_emb (full-width rotary only)."""
        attn, hd = self.base.layers[0].self_attn, self.base.layers[0].self_attn.head_dim
        g = torch.Generator().manual_seed(0)
        w = attn.q_proj.weight
        pos = torch.arange(7, device=w.device)[None] * 37
        cos, sin = self.base.rotary_emb(torch.zeros(1, 1, 1, device=w.device, dtype=w.dtype), position_ids=pos)
        if cos.shape[-1] != hd:
            return False
        q = (torch.randn((1, 7, 3, hd), generator=g) * 3).to(w)
        ref, _ = self.rotate(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
        return torch.equal(_rope(q, cos[:, :, None], _signed_sin(sin)[:, :, None]).transpose(1, 2), ref)

    def rotary_table(self, max_position: int, like: torch.Tensor) -> "RopeTable":
        """The rotary table of positions 0 .. P-1, P > max_position, in the dtype of like [B, Q, D] (rope_table
        models only): built with the model's own rotary module, grown to the next power of two when a position
        passes it. Each entry is a function of its position alone, so a larger table holds the same values."""
        if self._table is None or self._table.cos.shape[0] <= max_position:
            size = max(256, 1 << int(max_position).bit_length())  # next power of two above max_position
            pos = torch.arange(size, device=like.device)[None]
            cos, sin = self.base.rotary_emb(like[:1, :1], position_ids=pos)
            self._table = RopeTable(cos[0], sin[0], _signed_sin(sin[0]))
        return self._table

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor, max_position: Optional[int] = None) -> tuple:
        """The rotary factors of `position_ids` [B, Q] in the form `run` takes (one per forward, shared by its
        layer groups): rows of the table where the caller bounds the positions, else the module's."""
        if self.rope_table and max_position is not None:
            return self.rope_at(self.rotary_table(max_position, x), position_ids)
        cos, sin = self.base.rotary_emb(x, position_ids=position_ids)  # [B, Q, hd] each
        if self.fast_rope:
            return cos[:, :, None], _signed_sin(sin)[:, :, None]
        return cos, sin

    def rope_at(self, table: "RopeTable", position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`run`'s rotary factors of position_ids [B, Q] from a table (also the captured pass's, from its own):
        two row lookups, with the fast rotary broadcast over heads in the [B, Q, H, hd] layout."""
        if self.fast_rope:
            return table.cos[position_ids][:, :, None], table.signed_sin[position_ids][:, :, None]
        return table.cos[position_ids], table.sin[position_ids]

    @inference
    def __call__(
        self,
        inputs_embeds: torch.Tensor,  # [B, Q, D]
        bias: Optional[torch.Tensor],  # [B, 1, Q, S] additive; None = every key visible
        position_ids: torch.Tensor,  # [B, Q]
        cache: Any,  # a transformers Cache planned for this forward (kv_cache.KVCache)
        max_position: Optional[int] = None,  # an upper bound of position_ids, known on the host (None = unknown)
        keep: Optional[torch.Tensor] = None,  # [B, K] block positions whose hidden states are wanted (None = all)
    ) -> torch.Tensor:
        """hidden [B, Q, D], or [B, K, D] at the `keep` positions. With `keep` the last layer still attends at
        every position (its keys and values go to the cache) but projects the attention output and runs its MLP
        only at the kept positions: a prefill that needs the prompt's last token (and the masks after it) skips
        most of one layer's work per prompt token. Bitwise the full computation's rows (products of >= 4 rows
        are checked at start-up to give each row what a larger product gives it; else `keep` only selects)."""
        rope = self.rope(inputs_embeds, position_ids, max_position)
        h = self.run(inputs_embeds, 0, len(self.base.layers), rope, bias, cache, keep)
        return self.norm(h) if keep is None else self.norm(h)[:, : keep.shape[1]]

    @inference
    def run(self, h: torch.Tensor, start: int, stop: int, rope: tuple, bias: Optional[torch.Tensor | FlexMask],
            cache: Any, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Layers start .. stop-1 on h [B, Q, D] (no final norm): [B, Q, D]. `bias`: the additive bias [B, 1, Q, S]
        (None = causal or every key visible), or a compiled replayed pass's `FlexMask`. `keep` [B, K] (only with the model's
        last layer in the range): that layer's projection and MLP at the kept positions only, [B, K', D] with
        K' >= K (padded to a product of >= MIN_ROWS rows; the first K are the kept positions). DMTD runs its
        layer groups through here (model/dmtd.py)."""
        b = h.shape[0]
        last = len(self.base.layers) - 1
        if keep is not None:
            assert stop - 1 == last, "keep applies to the model's last layer"
        if self.compiled is not None:
            h = self.compiled.run(h, rope, self.pack(bias, h.shape[1]), cache, start, stop)
            return h if keep is None else gather_slots(h, keep)
        if keep is not None and not self.rows_invariant:
            return gather_slots(self.run(h, start, stop, rope, bias, cache), keep)
        bias = self.pack(bias, h.shape[1])  # tiled once here, not in every layer
        k = 0 if keep is None else keep.shape[1]
        if keep is not None and b * k < MIN_ROWS:  # pad to a product of >= MIN_ROWS rows (extra rows: position 0)
            keep = torch.cat([keep, keep.new_zeros(b, -(-MIN_ROWS // b) - k)], 1)
        for i in range(start, stop):
            part = self.parts[i]
            sel = keep if i == last else None
            a = self._attention(part, self.norms[i][0](h), rope, bias, cache, i, sel)
            h = (h if sel is None else gather_slots(h, sel)) + a
            h = h + self._mlp(part, self.norms[i][1](h), self.gate_up[i])
        return h

    def _rows_invariant(self) -> bool:
        """Each row of a product of the last layer's weights with >= MIN_ROWS rows is bitwise that row of a larger
        product (probes on the real weights): then computing only the kept rows changes no number."""
        layer = self.base.layers[-1]
        weights = [layer.self_attn.o_proj.weight, self.gate_up[-1].weight, layer.mlp.down_proj.weight]
        g = torch.Generator().manual_seed(0)
        for w in weights:
            x = (torch.randn((67, w.shape[1]), generator=g) * 2).to(w)
            full = F.linear(x, w)
            for m in (MIN_ROWS, 5, 7, 16, 33):
                if not torch.equal(F.linear(x[-m:].contiguous(), w), full[-m:]):
                    return False
        return True

    def _attention(self, part: "_LayerParts", x: torch.Tensor, rope, bias, cache: Any, i: int,
                   keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, q, _ = x.shape
        nq, nk = self.heads
        qkv = self.linear(x, self.qkv[i]).view(b, q, -1, part.head_dim)  # [B, Q, H + 2 Hkv, hd]
        qs, ks, vs = qkv[:, :, :nq], qkv[:, :, nq: nq + nk], qkv[:, :, nq + nk:]
        if self.qk_norm:
            qs, ks = self.norms[i][2](qs), self.norms[i][3](ks)
        if self.fast_rope and self.qk_norm:
            qs, ks = _rope(qs, *rope), _rope(ks, *rope)
        elif self.fast_rope:
            qk = _rope(qkv[:, :, : nq + nk], *rope)  # q and k heads in one go
            qs, ks = qk[:, :, :nq], qk[:, :, nq:]
        else:
            qs, ks = self.rotate(qs.transpose(1, 2), ks.transpose(1, 2), *rope)
        if self.fast_rope:
            qs, ks = qs.transpose(1, 2), ks.transpose(1, 2)  # [B, H(kv), Q, hd]
        ks, vs = cache.update(ks, vs.transpose(1, 2), i)  # [B, Hkv, S, hd]
        if isinstance(bias, FlexMask):  # a compiled replayed pass under engine.attention_backend=flex
            out = bias.attend(qs, ks, vs, part.scaling)  # [B, Q, H, hd]
        else:
            out, _ = self.attend(part.attn, qs, ks, vs, bias, dropout=0.0, scaling=part.scaling)  # [B, Q, H, hd]
        out = out.reshape(b, q, -1)
        if keep is not None:
            out = gather_slots(out, keep)  # [B, K, H * hd]
        return self.linear(out.contiguous(), part.o_proj)

    def _mlp(self, part: "_LayerParts", x: torch.Tensor, gate_up: Any) -> torch.Tensor:
        gate, up = self.linear(x, gate_up).chunk(2, dim=-1)
        return self.linear(part.act(gate) * up, part.down_proj)


# engine.attention_backend -> the SDPA kernels a decode pass may use, in torch's order of priority; math last, so
# that inputs the named kernel refuses still run
_BACKENDS = {"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH],
             "efficient": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], "math": [SDPBackend.MATH]}


def attention_backends(backend: str) -> Optional[list]:
    """The SDPA kernels for decode passes (engine.attention_backend; None = torch's own choice, which eager passes
    also keep under flex)."""
    return _BACKENDS.get(backend)


def sdpa_packed_gqa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    bias: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                    backends: Optional[list] = None):
    """`_sdpa_packed_gqa` with decode passes (a bias, keys beyond the block) restricted to `backends`
    (`attention_backends`); a prefill keeps torch's choice."""
    if backends is None or bias is None or key.shape[2] <= query.shape[2]:
        return _sdpa_packed_gqa(module, query, key, value, bias, dropout, scaling)
    with sdpa_kernel(backends):
        return _sdpa_packed_gqa(module, query, key, value, bias, dropout, scaling)


@dataclass(frozen=True)
class PackedBias:
    """An additive bias tiled for grouped-query heads packed into the query dimension (`_sdpa_packed_gqa`)."""

    packed: torch.Tensor  # [B, 1, g * Q, S]: bias [B, 1, Q, S] repeated for the g query heads of a key/value head


def packs(heads: int, kv_heads: int, q: int, head_dim: int) -> bool:
    """Whether `_sdpa_packed_gqa` packs a biased block of q inputs: grouped-query heads, and the bias's g copies
    smaller than the keys and values transformers' way would repeat (g * Q <= 2 * H * hd)."""
    g = heads // kv_heads
    return g > 1 and g * q <= 2 * heads * head_dim


def pack_bias(bias: torch.Tensor, g: int) -> torch.Tensor:
    """bias [B, 1, Q, S] -> [B, 1, g * Q, S], row j * Q + i = row i (the packed query order)."""
    b, _, q, s = bias.shape
    return bias[:, :, None].expand(b, 1, g, q, s).reshape(b, 1, g * q, s)


def _sdpa_packed_gqa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     bias: Optional[torch.Tensor | PackedBias], dropout: float = 0.0, scaling: Optional[float] = None):
    """transformers' sdpa attention, except that with a bias and grouped-query heads the g query heads of each
    key/value head are packed into the query dimension: query [B, H, Q, hd] -> [B, Hkv, g * Q, hd], bias
    [B, 1, Q, S] tiled g times. transformers repeats the keys and values per query head there instead
    (`repeat_kv`), a copy of the whole cache view per layer per pass: at batch 16 with 300 cached tokens a pass
    of Q = 2 spent 5.6 ms per layer copying against 0.3 ms packed (esp-tiny-llama, one CPU thread). Each query
    row sees the same keys in the same order either way; the tests check the result is bitwise equal.
    Packing copies the bias g times, so it is used while that is smaller than the keys and values
    (`packs`: g * Q <= 2 * H * hd; a long masked prefill keeps transformers' way); the decoder's layers take it
    tiled once per forward (a `PackedBias`). Returns ([B, Q, H, hd], None)."""
    b, h, q, hd = query.shape
    hkv = key.shape[1]
    if isinstance(bias, PackedBias):
        packed_bias = bias.packed  # tiled once for every layer (`DirectDecoder.pack`)
    elif bias is not None and packs(h, hkv, q, hd):
        packed_bias = pack_bias(bias, h // hkv)
    elif bias is None and q == 1 and hd == value.shape[-1] <= 256 and query.device.type in ("cpu", "cuda"):
        # one query token, every key visible: transformers' sdpa path (`sdpa_attention_forward`: no mask, not causal,
        # grouped-query heads through SDPA's enable_gqa) as one call, without its ~20 us of Python per layer per pass
        gqa = {"enable_gqa": True} if h != hkv else {}
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, **gqa)
        return out.transpose(1, 2), None
    else:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, bias, dropout=dropout, scaling=scaling)
    packed_q = query.reshape(b, hkv, h // hkv * q, hd)  # heads j * g .. j * g + g - 1 share key/value head j
    out = F.scaled_dot_product_attention(packed_q, key, value, attn_mask=packed_bias, dropout_p=dropout, scale=scaling)
    # reshape, not view: a CUDA kernel may return the packed output in another memory layout
    return out.reshape(b, h, q, hd).transpose(1, 2), None


def _linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """nn.Linear's own computation without nn.Module's call machinery (`layer`: a Linear or a `_Fused`)."""
    return F.linear(x, layer.weight, layer.bias)


def weight_major_linear(x: torch.Tensor, layer: Any) -> torch.Tensor:
    """x [..., in] times layer.weight [out, in]^T as weight @ x^T, for products of 2 .. FEW_ROWS rows (else
    `F.linear`). On the CPU `F.linear` over a few rows takes a small-M kernel that costs 1.3-1.8x one row, while
    the same product with the weight as the left operand streams the weight once and costs about one row
    (`scripts/row_costs.py`). It rounds differently from `F.linear`, so only a lossy method's own products use it."""
    flat = x.reshape(-1, x.shape[-1])
    if not 2 <= flat.shape[0] <= FEW_ROWS:
        return _linear(x, layer)
    out = torch.mm(layer.weight, flat.T).T  # [M, out]
    if layer.bias is not None:
        out = out + layer.bias
    return out.contiguous().view(*x.shape[:-1], -1)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with the first half negated: rotate_half(x) * sin == x.roll(hd/2) * _signed_sin(sin), bitwise
    (rotate_half(x) = [-x2, x1] and (-a) * b == a * (-b) exactly)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in 3 ops instead of 7: x [..., hd]."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


@dataclass(frozen=True)
class _LayerParts:
    """What a layer's pass reads of its modules, looked up once: nn.Module attribute access costs ~1 us each, ~15 per
    layer per pass. The weights stay the modules' own Parameters (loading a state dict copies into them)."""

    attn: Any  # the attention module (transformers' attention functions read its settings)
    head_dim: int
    scaling: float
    o_proj: "_Weights"
    down_proj: "_Weights"
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation

    @classmethod
    def of(cls, layer: Any) -> "_LayerParts":
        attn, mlp = layer.self_attn, layer.mlp
        return cls(attn, attn.head_dim, attn.scaling, _Weights.of(attn.o_proj), _Weights.of(mlp.down_proj),
                   mlp.act_fn.forward)


@dataclass(frozen=True)
class _Weights:
    """A Linear's weight and bias as plain attributes (`_linear` reads them)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]

    @classmethod
    def of(cls, linear: Any) -> "_Weights":
        return cls(linear.weight, linear.bias)


class _Fused:
    """x -> the outputs of parent.<names> side by side [..., sum(out)] from one product: their weights (and
    biases) become views of one buffer, so the model's own forward still reads the same numbers."""

    def __init__(self, parent: Any, names: tuple[str, ...]):
        mods = [getattr(parent, n) for n in names]
        has_bias = [m.bias is not None for m in mods]
        sizes = [m.weight.shape[0] for m in mods]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in mods])  # [sum(out), in]
            self.bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]) \
                if any(has_bias) else None
            for m, w in zip(mods, self.weight.split(sizes)):
                m.weight.data = w  # a view: memory is not doubled
            if self.bias is not None:
                for m, bb, had in zip(mods, self.bias.split(sizes), has_bias):
                    if had:
                        m.bias.data = bb


def _norm_fn(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The norm's computation: the first of the fused forms below that is bitwise the module's on a probe, else
    its forward.

    In float32 that is `F.rms_norm` with the weight. In a half type the module (Llama's, Qwen's) computes in
    float32 and rounds before the weight. `F.rms_norm` on the half input also computes in float32 and rounds
    its result (CUDA's kernel and the CPU's decomposition alike), so `weight * F.rms_norm(x)` is two kernels on
    CUDA; the explicit upcast, `weight * F.rms_norm(x.float()).to(dtype)`, is four; the module launches eight
    (upcast, square, mean, add, rsqrt, multiply, round, weight). A replayed pass at small batch is bound by its
    kernel count, so the fewest kernels that give the module's numbers win; the weight inside `F.rms_norm`
    (one kernel) is tried first, though in a half type a kernel that applies it before rounding differs."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    rms = type(norm).__name__.endswith("RMSNorm")
    if not (rms and w is not None and eps is not None and w.dtype.is_floating_point):
        return norm.forward
    shape = tuple(w.shape)
    forms: list[Callable[[torch.Tensor], torch.Tensor]] = [lambda x: F.rms_norm(x, shape, w, eps)]
    if w.dtype != torch.float32:
        forms += [lambda x: w * F.rms_norm(x, shape, None, eps),
                  lambda x: w * F.rms_norm(x.float(), shape, None, eps).to(x.dtype)]
    probe = (torch.randn((3, 5) + shape, generator=torch.Generator().manual_seed(0)) * 3).to(w.device, w.dtype)
    with torch.no_grad():
        want = norm.forward(probe)
        for form in forms:
            if torch.equal(form(probe), want):
                return form
    return norm.forward
