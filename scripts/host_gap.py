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
import os
import time

from devrun import add_run_args, engine_and_requests


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--gaps", default="0,0.5,1,2,4,8,16", help="milliseconds between passes, comma-separated")
    ap.add_argument("--sleep", action="store_true", help="sleep through the gap instead of a loop")
    args = ap.parse_args()
    eng, reqs = engine_and_requests(args)
    rows = reqs()
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
        d0, m0, n0 = eng.stats.decode_s, eng.stats.model_s, eng.stats.decode_passes
        eng.generate(reqs())
        d, m, n = eng.stats.decode_s - d0, eng.stats.model_s - m0, eng.stats.decode_passes - n0
        print(f"  gap {ms:5.1f} ms: host {1e6 * (d - m) / n:4.0f} us per pass ({n} passes)", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
