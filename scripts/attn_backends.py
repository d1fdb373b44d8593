"""Time PyTorch's attention backends at the engine's decode shapes, as a replayed pass runs them.

A decode pass's attention is `F.scaled_dot_product_attention` over grouped-query heads packed into the query
dimension (esp_worker/model/decoder.py, `sdpa_packed_gqa`): query [B, Hkv, g * Q, hd], keys and values
[B, Hkv, C, hd] (C = the shape class's key slots), an additive bias [B, 1, g * Q, C]. Each backend runs 20
calls captured in one CUDA graph (what a replayed pass pays: no launch cost from Python), replayed 10 times;
the table gives microseconds per call, the median of the replays. Defaults: Llama-3.2-1B's heads (32 query
heads, 8 key/value heads, head dim 64) in bfloat16. Column `flex`: FlexAttention under torch.compile with the bias
as its score_mod, over the unpacked query [B, H, Q, hd] (its decoding kernel splits the keys across thread blocks,
but it reads every key the bias covers). Column `flex_len`: the same visibility as a
block mask of the rows' lengths, so that key blocks past a row's block are never read: the engine's own path under
engine.attention_backend=flex (esp_worker/model/flex.py). Both are timed at Q = 1 with 512 and 2048 key slots at batch 1
and 64 only ('-' elsewhere: each shape is a compile).

    python scripts/attn_backends.py [--dtype bfloat16] [--out attn.txt]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def inputs(b: int, q: int, c: int, heads: tuple[int, int, int], dtype: torch.dtype):
    nq, nkv, hd = heads
    g = nq // nkv
    query = torch.randn(b, nkv, g * q, hd, device="cuda", dtype=dtype)
    key = torch.randn(b, nkv, c, hd, device="cuda", dtype=dtype)
    value = torch.randn(b, nkv, c, hd, device="cuda", dtype=dtype)
    hidden = torch.arange(c, device="cuda")[None, None, :] > (c // 2 + torch.arange(q, device="cuda"))[None, :, None]
    bias = torch.zeros(1, q, c, device="cuda", dtype=dtype).masked_fill_(hidden, torch.finfo(dtype).min)
    bias = bias.expand(b, q, c)[:, None, None].expand(b, 1, g, q, c).reshape(b, 1, g * q, c)  # as the engine packs
    return query, key, value, bias


def flex_call(g: int):
    """FlexAttention, compiled, on the engine's packed inputs unpacked: query [B, Hkv, g * Q, hd] -> [B, H, Q, hd],
    bias [B, 1, g * Q, C] -> its first Q rows (every group's are the same)."""
    from torch.nn.attention.flex_attention import flex_attention

    @torch.compile(fullgraph=True)
    def attend(query, key, value, bias):
        b, hkv, gq, hd = query.shape
        q = gq // g
        query = query.reshape(b, hkv * g, q, hd)
        rows = bias[:, :, :q]

        def add_bias(score, bi, h, qi, kv):
            return score + rows[bi, 0, qi, kv]

        return flex_attention(query, key, value, score_mod=add_bias, enable_gqa=True)

    return attend


def flex_len_call(g: int):
    """The engine's own FlexAttention path (engine.attention_backend=flex: esp_worker/model/flex.py) with the
    bias's visibility: each row's cache holds C/2 slots and its Q inputs see each other causally, so query i sees
    keys 0 .. C/2 + i. Key blocks past the block are skipped, those before it read whole, the one it ends in masked
    per key. The rows' lengths and the visibility are inputs of the compiled function, as in a compiled pass."""
    from esp_worker.model.flex import flex_mask

    @torch.compile(fullgraph=True, dynamic=False)
    def core(query, key, value, hist_len, visible):
        b, hkv, gq, hd = query.shape
        q = gq // g
        mask = flex_mask(hist_len, visible, q, key.shape[2])
        return mask.attend(query.reshape(b, hkv * g, q, hd), key, value, hd ** -0.5)

    def attend(query, key, value, bias):
        b, q, c, dev = query.shape[0], query.shape[2] // g, key.shape[2], query.device
        hist_len = torch.full((b,), c // 2 + 1, device=dev)  # C/2 cached slots per row
        visible = torch.ones(q, q, dtype=torch.bool, device=dev).tril()[None]
        return core(query, key, value, hist_len, visible)

    return attend


def time_backend(backend, args: tuple, calls: int = 20, replays: int = 10) -> float | None:
    """Microseconds per call inside a replayed graph, or None where the backend refuses the inputs. `backend`: an
    SDPBackend, or a callable of (query, key, value, bias) (flex)."""
    def run():
        if callable(backend):
            for _ in range(calls):
                backend(*args)
            return
        with sdpa_kernel([backend]):
            for _ in range(calls):
                F.scaled_dot_product_attention(*args[:3], attn_mask=args[3])
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    except Exception:  # noqa: BLE001 - a kernel that refuses the inputs, or a compile that fails: no number
        return None
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--heads", default="32,8,64", help="query heads, key/value heads, head dim")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("attn_backends: needs CUDA")
        return 1
    dtype = getattr(torch, a.dtype)
    heads = tuple(int(x) for x in a.heads.split(","))
    lines = [f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {a.dtype}, heads {heads}: "
             "us per call in a replayed graph", "",
             "| batch | Q | key slots | " + " | ".join(BACKENDS) + " | flex | flex_len | fastest |",
             "|---|---|---|" + "---|" * (len(BACKENDS) + 3)]

    for b in (1, 16, 64):
        for q in (1, 8, 32):
            for c in (128, 512, 2048):
                args = inputs(b, q, c, heads, dtype)
                us = {name: time_backend(be, args) for name, be in BACKENDS.items()}
                # a compile per shape (seconds each): only the plain pass at two lengths
                flex_here = q == 1 and c in (512, 2048) and b in (1, 64)
                us["flex"] = time_backend(flex_call(heads[0] // heads[1]), args) if flex_here else None
                us["flex_len"] = time_backend(flex_len_call(heads[0] // heads[1]), args) if flex_here else None
                ok = {k: v for k, v in us.items() if v is not None}
                best = min(ok, key=ok.get) if ok else "-"
                cells = " | ".join("-" if v is None else f"{v:.1f}" for v in us.values())
                lines.append(f"| {b} | {q} | {c} | {cells} | {best} |")
                print(lines[-1], flush=True)
                del args
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
