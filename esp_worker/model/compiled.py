"""`engine.compile=true`: the direct decoder's per-layer work compiled with `torch.compile`.

Each decoder layer is three steps: `pre` (input RMSNorm, the fused q/k/v product, Qwen3's q/k norms, rotary),
the attention over the KV cache, and `post` (output projection, residual, RMSNorm, the fused gate/up product,
activation, down projection, residual). `pre` and `post` are pure functions of tensors, the same for every
layer (the layer's weights are arguments) and the same for every token (they see a pass's B * Q tokens as one
dim, marked unbacked, so that a count of 1 is not specialised), so a job compiles two graphs in all, whatever
its batch, block sizes and cache lengths. The attention and the in-place cache writes stay eager: they touch
the cache's buffers, whose views change every pass.

Compiled kernels round differently from eager ones (fused reductions), so with compile on, output equals the
same engine's plain decoding (every pass runs the same compiled code) and `generate`'s up to float rounding,
the same guarantee as between a tree pass and a one-token pass. Compile time is counted in `compile_s`.
On a GPU, `mode` may name a torch.compile mode (e.g. "max-autotune-no-cudagraphs").
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .errors import ModelLoadError


class CompileUnsupported(ModelLoadError):
    """This model's layers do not fit the compiled form; one line."""


def _pre_fn(eps: float, qk_eps: Optional[float], nq: int, nk: int, hd: int) -> Callable:
    def pre(h, norm_w, qkv_w, qkv_b, q_norm_w, k_norm_w, cos, signed_sin):
        # h [N, D] (the pass's B * Q tokens), cos / signed_sin [N, 1, hd] -> q [N, H, hd], k / v [N, Hkv, hd]
        torch._check(h.shape[0] >= 1)  # (N is unbacked: `_tokens`)
        x = F.rms_norm(h, (h.shape[-1],), norm_w, eps)
        qkv = F.linear(x, qkv_w, qkv_b).view(-1, nq + 2 * nk, hd)
        qs, ks, vs = qkv[:, :nq], qkv[:, nq: nq + nk], qkv[:, nq + nk:]
        if q_norm_w is not None:
            qs = F.rms_norm(qs, (hd,), q_norm_w, qk_eps)
            ks = F.rms_norm(ks, (hd,), k_norm_w, qk_eps)
        qs = qs * cos + qs.roll(hd // 2, -1) * signed_sin
        ks = ks * cos + ks.roll(hd // 2, -1) * signed_sin
        return qs, ks, vs

    return pre


class PostWeights(NamedTuple):
    """One layer's weights after its attention, as `post` takes them (a NamedTuple: torch.compile reads its fields
    as graph inputs, so every layer's tuple runs the same graph). Biases are None where the model has none."""

    o: torch.Tensor  # [D, H * hd] output projection
    o_bias: Optional[torch.Tensor]
    norm: torch.Tensor  # [D] post-attention RMSNorm
    gate_up: torch.Tensor  # [2 I, D] the fused gate and up projections
    gate_up_bias: Optional[torch.Tensor]
    down: torch.Tensor  # [D, I]
    down_bias: Optional[torch.Tensor]


def _post_fn(eps: float, act: Callable) -> Callable:
    def post(h, attn, w: PostWeights):
        # h [N, D], attn [N, H * hd] -> h [N, D]
        h = h + F.linear(attn, w.o, w.o_bias)
        x = F.rms_norm(h, (h.shape[-1],), w.norm, eps)
        gate, up = F.linear(x, w.gate_up, w.gate_up_bias).chunk(2, dim=-1)
        return h + F.linear(act(gate) * up, w.down, w.down_bias)

    return post


def _rms_eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    if not type(norm).__name__.endswith("RMSNorm") or eps is None or getattr(norm, "weight", None) is None:
        raise CompileUnsupported(f"engine.compile supports RMSNorm layers, not {type(norm).__name__}; set engine.compile=false")
    return float(eps)


class CompiledLayers:
    """Compiled `pre` and `post` of every layer of a DirectDecoder (see the module docstring)."""

    def __init__(self, dec: Any, mode: Optional[str] = None):
        if not dec.fast_rope:
            raise CompileUnsupported("engine.compile needs full-width rotary embeddings; set engine.compile=false")
        layers = dec.base.layers
        eps = {_rms_eps(n) for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        qk_eps = {_rms_eps(n) for layer in layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)} \
            if dec.qk_norm else {None}
        acts = {type(layer.mlp.act_fn) for layer in layers}
        if len(eps) != 1 or len(qk_eps) != 1 or len(acts) != 1:
            raise CompileUnsupported("engine.compile needs every layer to share its norm epsilon and activation; set engine.compile=false")
        nq, nk = dec.heads
        hd = layers[0].self_attn.head_dim
        e = eps.pop()
        opts = {"dynamic": False, "fullgraph": True, **({"mode": mode} if mode else {})}
        self.pre = torch.compile(_pre_fn(e, qk_eps.pop(), nq, nk, hd), **opts)
        self.post = torch.compile(_post_fn(e, layers[0].mlp.act_fn), **opts)
        self.dec = dec
        self.post_weights = [
            PostWeights(layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, layer.post_attention_layernorm.weight,
                        gu.weight, gu.bias, layer.mlp.down_proj.weight, layer.mlp.down_proj.bias)
            for layer, gu in zip(layers, dec.gate_up)
        ]
        self.compile_s = 0.0  # wall seconds of the calls that compiled a graph
        self.graphs = 0

    def layer(self, i: int, h: torch.Tensor, rope: tuple, bias: Optional[torch.Tensor], cache: Any, b: int, q: int) -> torch.Tensor:
        """Layer i over h [B * Q, D] -> [B * Q, D]; rope's cos and signed sin [B * Q, 1, hd]."""
        dec, layer = self.dec, self.dec.base.layers[i]
        attn = layer.self_attn
        qn = attn.q_norm.weight if dec.qk_norm else None
        kn = attn.k_norm.weight if dec.qk_norm else None
        qkv = dec.qkv[i]
        qs, ks, vs = self.pre(_tokens(h), layer.input_layernorm.weight, qkv.weight, qkv.bias, qn, kn, *rope)
        qs, ks, vs = (t.view(b, q, -1, t.shape[-1]).transpose(1, 2) for t in (qs, ks, vs))  # [B, heads, Q, hd]
        ks, vs = cache.update(ks, vs, i)  # [B, Hkv, S, hd]
        out, _ = dec.attend(attn, qs, ks, vs, bias, dropout=0.0, scaling=attn.scaling)
        return self.post(h, _tokens(out.reshape(b * q, -1)), self.post_weights[i])

    def run(self, h: torch.Tensor, rope: tuple, bias: Optional[torch.Tensor], cache: Any, start: int = 0,
            stop: Optional[int] = None) -> torch.Tensor:
        """Layers start .. stop-1 (all by default); the first call of a new shape class (a compile) is timed into
        compile_s."""
        from torch._dynamo.utils import counters

        before = counters["stats"]["unique_graphs"]
        t0 = time.perf_counter()
        b, q, d = h.shape
        rope = tuple(_tokens(r.reshape(b * q, *r.shape[2:])) for r in rope)
        h = h.reshape(b * q, d)
        for i in range(start, len(self.dec.base.layers) if stop is None else stop):
            h = self.layer(i, h, rope, bias, cache, b, q)
        new = counters["stats"]["unique_graphs"] - before
        if new:
            self.graphs += new
            self.compile_s += time.perf_counter() - t0
        return h.view(b, q, d)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """x with its first dim (the pass's tokens) marked unbacked: a graph then serves every token count, one
    included (a dynamic size of 1 would otherwise get a graph of its own, and so would the sizes' relations)."""
    torch._dynamo.decorators.mark_unbacked(x, 0)
    return x
