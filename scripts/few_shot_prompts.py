"""A few-shot variant of a prompt file, for measuring engine.prefix_cache_tokens: per category, the first N prompts
become examples that every other prompt of the category starts with (the shared prefix an evaluation job has).

    python scripts/few_shot_prompts.py ../shared/data/tiny_prompts_dev.jsonl 2 > /tmp/few_shot.jsonl
"""
from __future__ import annotations

import collections
import json
import sys


def few_shot(rows: list[dict], n: int) -> list[dict]:
    by_category: dict[str, list[dict]] = collections.defaultdict(list)
    for row in rows:
        by_category[row.get("category", "")].append(row)
    out = []
    for group in by_category.values():
        examples = "\n\n".join(r["prompt"] for r in group[:n])
        out += [{**r, "prompt": f"{examples}\n\n{r['prompt']}"} for r in group[n:]]
    return out


if __name__ == "__main__":
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for row in few_shot(rows, n):
        print(json.dumps(row))
