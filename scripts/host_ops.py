"""Host work per decode pass, by phase: tensor operations (counted with a TorchDispatchMode) and host time.

    python scripts/host_ops.py --model ../shared/models/esp-tiny-llama --method esp --bc 30 [--prompts 12]

Runs the prompts of `--data` once to warm up, then once with every dispatched tensor operation counted and
attributed to the engine phase that issued it (plan, propose, forward inputs, verify, stops, keep, commit,
count, record, observe, end_pass, read_back, other), then `--repeats` more times timed (no counting): host time per pass is decode time
outside the model's forward and LM head (`Engine.stats`), as the benchmark's `host overhead` column. The
model's own operations (forward, LM head, the drafter's LM-head calls) are listed apart and not counted as
host work. One torch thread; batch `--batch`. A development tool: the numbers are this machine's.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os

from torch.utils._python_dispatch import TorchDispatchMode

from devrun import add_run_args, engine_and_requests
from esp_worker import batch as batch_mod  # importable once devrun put the repository on the path
from esp_worker.graphs import buffers as graph_buffers, runner as graph_runner

PHASES = ("_forward", "_verify", "_stops", "_commit", "_record", "_end_pass", "_prefill", "_retire")  # Engine's
NOT_HOST = ("model", "prefill", "retire", "graph")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ops", action="store_true", help="also list the operations of each phase, per pass")
    args = ap.parse_args()
    eng, reqs = engine_and_requests(args, args.batch)
    rows = reqs()
    eng.generate(reqs())  # warm-up

    phase = ["other"]
    counts: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[tuple[str, str]] = collections.Counter()

    def label(obj, name: str, tag: str) -> None:
        f = getattr(obj, name)

        @functools.wraps(f)
        def g(*a, **k):
            prev, phase[0] = phase[0], tag
            try:
                return f(*a, **k)
            finally:
                phase[0] = prev

        setattr(obj, name, g)

    for name in PHASES:
        label(eng, name, name.strip("_"))
    label(eng.planner, "plan", "plan")
    label(eng.drafter, "propose", "propose")
    label(eng.drafter, "observe", "observe")
    label(batch_mod.Rows, "keep_path", "keep")
    label(eng.runner, "forward", "model")
    label(eng.runner, "logits", "model")
    if hasattr(eng.drafter, "probe"):  # ESP-like drafters' probe holds the runner's LM head
        label(eng.drafter.probe, "logits", "model")
    label(batch_mod.Rows, "count", "count")
    label(batch_mod.Rows, "read_back", "read_back")
    if eng.graphs is not None:  # --graphs: what a CUDA graph would replay is not host work; its input copies are
        label(graph_runner, "decode_step", "graph")
        label(graph_buffers.StepOutput, "copy_", "graph")  # a CPU's stand-in for the replay writing its outputs
        label(eng.graphs, "_fill", "graph_fill")

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[phase[0]] += 1
            by_op[phase[0], str(func.overloadpacket.__name__)] += 1
            return func(*args, **(kwargs or {}))

    p0 = eng.stats.decode_passes
    with Count():
        eng.generate(reqs())
    passes = eng.stats.decode_passes - p0
    host = 0.0
    print(f"{args.method} BC {args.bc}, batch {args.batch}, {len(rows)} prompts: {passes} decode passes")
    print("tensor operations per pass:")
    for k, v in sorted(counts.items(), key=lambda kv: -kv[1]):
        if k in NOT_HOST:
            print(f"  ({k:9s} {v / passes:6.1f}  not host work)")
            continue
        host += v / passes
        print(f"  {k:11s} {v / passes:6.1f}")
    print(f"  host total  {host:6.1f}")
    if args.ops:
        for k in sorted(counts, key=lambda k: -counts[k]):
            if k not in NOT_HOST:
                ops = sorted(((n, c) for (ph, n), c in by_op.items() if ph == k), key=lambda nc: -nc[1])
                print(f"  {k}: " + ", ".join(f"{n} {c / passes:.1f}" for n, c in ops))
    for _ in range(args.repeats):
        d0, m0, n0 = eng.stats.decode_s, eng.stats.model_s, eng.stats.decode_passes
        eng.generate(reqs())
        d, m, n = eng.stats.decode_s - d0, eng.stats.model_s - m0, eng.stats.decode_passes - n0
        print(f"timed run: host share {1 - m / d:.3f}, host {1e6 * (d - m) / n:.0f} us per pass, "
              f"model {1e6 * m / n:.0f} us per pass")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
