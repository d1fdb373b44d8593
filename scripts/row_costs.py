"""What a matrix product over a few rows costs against one row on this CPU, with the weights out of cache (as in a
decode pass, which reads every layer's weights once): the arithmetic behind DMTD's refill (docs/methods/dmtd.md).

    python scripts/row_costs.py [--model ../shared/models/esp-tiny-llama] [--rows 1 2 3 4 8 12 16]

For each weight shape of the model's layers (the fused q/k/v and gate/up products, as model/decoder.py runs them,
o_proj, down_proj) and its LM head: microseconds per `F.linear` of M rows, the weights cycled through copies that
add up to 64 MB so that each product reads its weight from memory. One torch thread; medians of 5 rounds. The
last row is a layer's products computed weight-major (`weight_major_linear`, which DMTD's refill takes for 2 to
FEW_ROWS rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from esp_worker.model.decoder import weight_major_linear


def product_us(shape: tuple[int, int], rows: int, weight_major: bool = False, footprint: float = 64e6) -> float:
    n, k = shape
    layers = [torch.nn.Linear(k, n, bias=False) for _ in range(max(2, int(footprint / (n * k * 4))))]
    x = torch.randn(rows, k)
    product = weight_major_linear if weight_major else (lambda x, layer: F.linear(x, layer.weight))
    with torch.no_grad():
        for layer in layers:  # warm-up
            product(x, layer)
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for layer in layers:
                product(x, layer)
            rounds.append((time.perf_counter() - t0) / len(layers) * 1e6)
    return statistics.median(rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1].parent / "shared/models/esp-tiny-llama"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 12, 16])
    args = ap.parse_args()
    torch.set_num_threads(1)
    c = json.loads((Path(args.model) / "config.json").read_text())
    d, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    shapes = {"q/k/v": (qkv, d), "o_proj": (d, c["num_attention_heads"] * hd),
              "gate/up": (2 * c["intermediate_size"], d), "down_proj": (d, c["intermediate_size"]),
              "LM head": (c["vocab_size"], d)}
    print("| product [out, in] | " + " | ".join(f"M = {m}" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    layer = {m: 0.0 for m in args.rows}
    major = {m: 0.0 for m in args.rows}
    for name, shape in shapes.items():
        us = {m: product_us(shape, m) for m in args.rows}
        if name != "LM head":
            for m in args.rows:
                layer[m] += us[m]
                major[m] += product_us(shape, m, weight_major=True)
        print(f"| {name} {list(shape)} | " + " | ".join(f"{us[m]:.0f}" for m in args.rows) + " |")
    for what, costs in (("a layer's products", layer), ("a layer's products, weight-major", major)):
        print(f"| {what} | " + " | ".join(f"{costs[m]:.0f} ({costs[m] / layer[args.rows[0]]:.2f}x)"
                                        for m in args.rows) + " |")


if __name__ == "__main__":
    main()
