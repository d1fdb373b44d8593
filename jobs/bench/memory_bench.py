"""Peak memory of speculative decoding against plain decoding, each method in a fresh process.

    python -m jobs.memory_bench [model.name_or_path] [--batch 8] [--prompt-tokens 1000] [--new 64]

Reports, per method: the peak resident memory of the whole batch run (prefill + decode) above the memory
held after loading the model and one warm-up request (Linux `VmHWM`, reset via /proc/self/clear_refs), the
peak KV-cache size during a pass (cache + the block being verified), and both as ratios to `ar`. Prompts
are windows of the bundled prompts' tokens, `--prompt-tokens` long.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

METHODS = (("ar", {}), ("esp", {"block_complexity": 30}), ("esp", {"block_complexity": 60, "num_masks": 2}),
           ("pld", {"block_complexity": 11}))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _child(model: str, method: str, extra: dict[str, Any], batch: int, prompt_tokens: int, new: int) -> dict[str, Any]:
    import torch

    from esp_worker import Engine, EngineConfig, GenerationParams, ModelConfig, Request, load_model

    torch.set_num_threads(1)
    lm = load_model(ModelConfig(name_or_path=model))
    from ..io.sources import open_source

    rows = [r for b in open_source("", "auto", "train", None).batches(64) for r in b]
    texts = [r["prompt"] for r in rows if isinstance(r.get("prompt"), str)]
    text = "\n".join(texts)
    ids = lm.tokenizer(text)["input_ids"]
    prompts = [ids[i * 7 : i * 7 + prompt_tokens] for i in range(batch)]
    eng = Engine(lm, EngineConfig(method=method, max_batch_size=batch, **extra))
    reqs = [Request(id=str(i), prompt_ids=p, params=GenerationParams(max_new_tokens=new, ignore_eos=True))
            for i, p in enumerate(prompts)]
    eng.generate(reqs[:1])  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_kib("VmRSS")
    outs = eng.generate(reqs)
    peak = _rss_kib("VmHWM")
    return dict(method=method, **extra, rss_base_mib=base / 1024, rss_peak_above_base_mib=(peak - base) / 1024,
                peak_kv_mib=eng.stats.peak_cache_bytes / 2**20, tokens=sum(len(o.token_ids) for o in outs))


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m jobs.memory_bench", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="tiny-random-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        method, extra = json.loads(a.child)
        print(json.dumps(_child(a.model, method, extra, a.batch, a.prompt_tokens, a.new)))
        return 0
    rows = []
    for method, extra in METHODS:
        cmd = [sys.executable, "-m", "jobs.bench.memory_bench", a.model, "--batch", str(a.batch), "--prompt-tokens",
               str(a.prompt_tokens), "--new", str(a.new), "--child", json.dumps([method, extra])]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    ar = rows[0]
    print("| method | peak RSS of the run above the loaded baseline (MiB) | ratio | peak KV cache during a pass (MiB) | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = r["method"] + "".join(f" {k}={v}" for k, v in r.items() if k in ("block_complexity", "num_masks"))
        print(f"| {name} | {r['rss_peak_above_base_mib']:.1f} | {r['rss_peak_above_base_mib'] / max(ar['rss_peak_above_base_mib'], 1e-9):.2f} "
              f"| {r['peak_kv_mib']:.1f} | {r['peak_kv_mib'] / ar['peak_kv_mib']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
