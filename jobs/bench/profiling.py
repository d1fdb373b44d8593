"""`bench.profile`: one more untimed run of chosen settings under torch.profiler, written as op tables.

The run covers the first `batch` prompts (one batch: the tables read per pass, and a trace of every prompt
takes minutes to tabulate); it comes after the timed runs' records are written.

What it answers: where a setting's time goes, op by op, on the machine at hand (on a GPU: which kernels,
which attention backend per input shape, how much of a pass is the model's calls and how much the drafter's
and the engine's). The model's calls are marked `model.forward` and `model.logits` (record_function in
`esp_worker.model.load.ModelRunner`, on only while profiling), so their share is one row of the table.

Files (per setting and batch size): `profile-<label>-b<batch>.txt` with two tables, ops by self time (device
time on CUDA, CPU time otherwise) and the same grouped by input shape, and the number of decode passes the run
made, to read the tables per pass.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .results import SettingRun


def profile_run(run: Callable[[], SettingRun], label: str, batch: int, out: Path, device_type: str,
                rows: int = 40) -> Path:
    """Run `run()` once under torch.profiler; write the tables; return the file written."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from esp_worker.model.runner import ModelRunner

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])
    ModelRunner.profile_marks = True
    try:
        with profile(activities=activities, record_shapes=True) as prof:
            result = run()
            if device_type == "cuda":
                torch.cuda.synchronize()
    finally:
        ModelRunner.profile_marks = False
    key = "self_cuda_time_total" if device_type == "cuda" else "self_cpu_time_total"
    passes = sum(getattr(getattr(o, "stats", None), "num_decode_passes", 0) for o in result.outputs.values())
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", label)
    path = out / f"profile-{name}-b{batch}.txt"
    seconds = sum(result.seconds.values())
    text = [
        f"# {label}, batch {batch}: one untimed run under torch.profiler ({seconds:.2f} s with the profiler on); "
        f"{passes} row-passes (decode passes summed over requests)",
        "",
        f"## ops by {key}",
        prof.key_averages().table(sort_by=key, row_limit=rows),
        "",
        f"## ops by {key}, grouped by input shape",
        prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows),
    ]
    path.write_text("\n".join(text))
    return path


def matches(spec: str, method: str, block_complexity: Any, heads_path: str) -> bool:
    """Whether a `bench.profile` entry ("method:BC", "ar", "hybrid+heads:auto") names this setting."""
    m, _, bc = str(spec).partition(":")
    heads = m == "hybrid+heads"
    m = "hybrid" if heads else m
    if m != method or heads != (method == "hybrid" and bool(heads_path)):
        return False
    return m in ("ar", "hf") or bc == str(block_complexity)
