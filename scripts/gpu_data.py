"""Write the prompt files `scripts/gpu_checks.sh` reads (a device machine has no
`../shared`, so they travel in the ignored folder `gpu_data/`, named in the device call's `carry`):

    python scripts/gpu_data.py [--src ../shared/data/tiny_prompts_dev.jsonl] [--out gpu_data]

prompts4 / 8 / 16: the first 2 / 4 / 8 code and verse prompts each; prompts64: all 60 dev prompts and the first
2 code and 2 verse again (ids suffixed `-again`); prompts120: all of them twice (`-again`); prompts128: 64 of each
category (all, again, and the first 4 a third time, `-again2`), so that batch 64 holds 64 rows (the bench runs
categories one at a time)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(here.parent / "shared" / "data" / "tiny_prompts_dev.jsonl"))
    ap.add_argument("--out", default=str(here / "gpu_data"))
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.src).read_text().splitlines() if line.strip()]
    code = [r for r in rows if r.get("category") == "code"]
    verse = [r for r in rows if r.get("category") == "verse"]
    again = lambda rs: [dict(r, id=f"{r['id']}-again") for r in rs]  # noqa: E731
    files = {f"prompts{2 * n}.jsonl": code[:n] + verse[:n] for n in (2, 4, 8)}
    files["prompts64.jsonl"] = code + verse + again(code[:2] + verse[:2])
    files["prompts120.jsonl"] = code + verse + again(code + verse)
    third = lambda rs: [dict(r, id=f"{r['id']}-again2") for r in rs]  # noqa: E731
    files["prompts128.jsonl"] = [r for rs in (code, verse) for r in rs + again(rs) + third(rs[: 64 - 2 * len(rs)])]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rs in files.items():
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in rs))
        print(f"{out / name}: {len(rs)} prompts")


if __name__ == "__main__":
    main()
