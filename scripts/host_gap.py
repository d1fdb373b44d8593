"""Host time per decode pass against the time between passes: the model's forward replaced by a wait.

    python scripts/host_gap.py --model ../shared/models/esp-tiny-llama --method esp --bc 30 [--gaps 0,1,2,4,8,16]

Runs the prompts once as they are (warm-up), then once per gap with every decode pass's model forward replaced
by a wait of that many milliseconds that touches no memory (a Python loop reading the clock; `--sleep` sleeps
instead) and returns its input as the hidden states. The engine's host work is the same in every run (the LM
head still runs, on those hidden states, so drafts and passes are those of a model that accepts nothing); what
changes is only how long the host code waits between passes. Host time per pass is decode time outside the
model's forward and LM head, as `scripts/host_ops.py` and the benchmark's `host overhead` column count it. A
development tool: the numbers are this machine's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from esp_worker.config import EngineConfig, ModelConfig  # noqa: E402
from esp_worker.engine import Engine  # noqa: E402
from esp_worker.types import GenerationParams, Request  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shared = Path(__file__).resolve().parents[2] / "shared"
    ap.add_argument("--model", default=str(shared / "models" / "esp-tiny-llama"))
    ap.add_argument("--data", default=str(shared / "data" / "tiny_prompts_dev.jsonl"))
    ap.add_argument("--method", default="esp")
    ap.add_argument("--bc", default="30", help="block complexity (an int or auto)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--gaps", default="0,0.5,1,2,4,8,16", help="milliseconds between passes, comma-separated")
    ap.add_argument("--sleep", action="store_true", help="sleep through the gap instead of a loop")
    args = ap.parse_args()
    torch.set_num_threads(1)
    bc = args.bc if args.bc == "auto" else int(args.bc)
    eng = Engine.from_config(ModelConfig(name_or_path=args.model),
                             EngineConfig(method=args.method, block_complexity=bc, num_masks=1, tree="static",
                                          max_batch_size=1))
    rows = [json.loads(line) for line in open(args.data)][: args.prompts]
    reqs = lambda: [Request(id=str(i), prompt=r["prompt"], params=GenerationParams(max_new_tokens=args.max_new_tokens))  # noqa: E731
                    for i, r in enumerate(rows)]
    eng.generate(reqs())  # warm-up, with the model

    real, gap = eng.runner._forward, [0.0]

    def wait_instead(inputs_embeds, bias, position_ids, cache, max_position, keep):
        if keep is not None:  # a prefill: the real forward
            return real(inputs_embeds, bias, position_ids, cache, max_position, keep)
        if args.sleep:
            time.sleep(gap[0])
        else:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < gap[0]:
                pass
        return inputs_embeds.clone()

    eng.runner._forward = wait_instead
    print(f"{args.method} BC {args.bc}, batch 1, {len(rows)} prompts, the forward replaced by a "
          f"{'sleep' if args.sleep else 'loop'}")
    for ms in (float(x) for x in args.gaps.split(",")):
        gap[0] = ms / 1000
        d0, m0, n0 = eng.timing["decode_s"], eng.timing["model_s"], eng.timing["decode_passes"]
        eng.generate(reqs())
        d, m, n = eng.timing["decode_s"] - d0, eng.timing["model_s"] - m0, eng.timing["decode_passes"] - n0
        print(f"  gap {ms:5.1f} ms: host {1e6 * (d - m) / n:4.0f} us per pass ({n} passes)", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
