"""Time of one decode step, eager and compiled (Inductor), against the size of the KV slab it writes into.

    python scripts/compiled_step_slab.py [--arch llama] [--slots 1024 16384 65536]

A plain pass (batch 1) of `tiny-random-<arch>` after a short job, then the class's step on slabs of more and
more slots (the class reads the same capacity; only the slab around it grows). A compiled step that copies the
slab per write shows as time growing with it. One torch thread; a development tool: the numbers are this
machine's.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

here = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(here), str(here / "tests")]
from engine_helpers import PROMPTS, tiny  # noqa: E402
from esp_worker import Engine, EngineConfig, GenerationParams, Request  # noqa: E402
from esp_worker.graphs.step import decode_step  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--slots", type=int, nargs="+", default=[1024, 16384, 65536])
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    eng = Engine(tiny(args.arch), EngineConfig(max_batch_size=1, cuda_graphs=True, method="ar"))
    params = GenerationParams(max_new_tokens=12)
    eng.generate([Request(id=str(i), prompt=p, params=params) for i, p in enumerate(PROMPTS)])
    g = eng.graphs
    shape = max(g._entries, key=lambda s: s.capacity)
    inp = g._entries[shape].inp
    compiled = torch.compile(decode_step, fullgraph=True, dynamic=False)
    print(f"{shape}\nslots | slab MB | eager us | compiled us")
    for slots in args.slots:
        s = g.cache.slab.shape
        slab = torch.zeros(s[:4] + (slots, s[5]), dtype=g.cache.slab.dtype)
        row = [str(slots), f"{slab.numel() * slab.element_size() / 1e6:.1f}"]
        with torch.inference_mode():
            for f in (decode_step, compiled):
                for _ in range(3):
                    f(g.model, slab, inp, shape)
                t = time.perf_counter()
                for _ in range(args.repeats):
                    f(g.model, slab, inp, shape)
                row.append(f"{(time.perf_counter() - t) / args.repeats * 1e6:.0f}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
