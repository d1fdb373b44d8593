"""What the development scripts share: the command-line options of one engine run and the engine and
requests they describe (one torch thread, static one-mask trees as the benchmark's ESP settings)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from esp_worker.config import EngineConfig, ModelConfig  # noqa: E402
from esp_worker.engine import Engine  # noqa: E402
from esp_worker.types import GenerationParams, Request  # noqa: E402


def add_run_args(ap: argparse.ArgumentParser) -> None:
    shared = Path(__file__).resolve().parents[2] / "shared"
    ap.add_argument("--model", default=str(shared / "models" / "esp-tiny-llama"))
    ap.add_argument("--data", default=str(shared / "data" / "tiny_prompts_dev.jsonl"))
    ap.add_argument("--method", default="esp")
    ap.add_argument("--bc", default="30", help="block complexity (an int or auto)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--graphs", action="store_true",
                    help="engine.cuda_graphs=true (on a CPU: the static path, eagerly)")


def engine_and_requests(args: argparse.Namespace, batch: int = 1) -> tuple[Engine, Callable[[], list[Request]]]:
    """The engine of `args` (at most `batch` rows) and a function that makes the run's requests afresh."""
    torch.set_num_threads(1)
    bc = args.bc if args.bc == "auto" else int(args.bc)
    eng = Engine.from_config(ModelConfig(name_or_path=args.model),
                             EngineConfig(method=args.method, block_complexity=bc, num_masks=1, tree="static",
                                          max_batch_size=batch,
                                          cuda_graphs=True if args.graphs else "auto"))
    rows = [json.loads(line) for line in open(args.data)][: args.prompts]

    def requests() -> list[Request]:
        return [Request(id=str(i), prompt=r["prompt"], params=GenerationParams(max_new_tokens=args.max_new_tokens))
                for i, r in enumerate(rows)]

    return eng, requests
