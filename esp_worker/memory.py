"""Whether a KV cache the engine is about to allocate fits the device, asked before it allocates one.

The engine allocates a cache sized by engine.max_batch_size, not by the rows a job has, in two places: the slab
pinned for CUDA graphs (`max_batch_size` rows of `cuda_graph_max_len` slots) and the `auto` policy's calibration,
which times passes at the full batch. A size past the device's memory fails there deep inside torch on a GPU and,
on a CPU, gets the process killed by the kernel with no message at all (a job's actors then die at every restart).
So each asks here first and a size that cannot fit is one line naming the setting. The estimate counts the KV cache
and the largest pass's attention bias and logits, a lower bound of what is needed: it refuses what cannot work and
lets what might.

While it generates, the engine asks the same before its KV cache grows (long rows join the batch) and before a
batched prefill builds its attention mask: refused there, the error is one of the rows in the batch, which a job's
actor runs again in halves (jobs/run/worker.py), where a row that does not fit alone gets it in its `error`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from .model.errors import ModelLoadError

GIB = float(1 << 30)


class MemoryShortError(ModelLoadError):
    """An allocation the engine is about to make (a KV cache, a batched prefill's mask) exceeds the device's free
    memory: at start-up a configuration's error, while generating an error of the batch's rows."""


def kv_bytes_per_slot(text_config: Any, dtype: torch.dtype) -> int:
    """Bytes of one row's one cached position: every layer's key and value."""
    heads = int(getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads)
    return int(text_config.num_hidden_layers) * 2 * heads * head_dim * dtype.itemsize


def pass_bytes(text_config: Any, dtype: torch.dtype, rows: int, q: int, view_len: int) -> int:
    """Bytes an eager pass of `q` new tokens a row over `view_len` positions allocates at least, beside the cache:
    its attention bias [rows, q, view_len] and its float32 logits [rows, q, vocab]."""
    return rows * q * (view_len * dtype.itemsize + int(text_config.vocab_size) * 4)


def free_bytes(device: torch.device) -> Optional[int]:
    """What the device can still allocate: on CUDA the driver's free memory plus what torch holds unused; on a CPU
    the kernel's MemAvailable, or the cgroup's limit less its use where that is lower (a container's limit is
    not in /proc/meminfo). None when it cannot be read: then nothing is refused."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type != "cpu":
        return None
    found = [_meminfo_available(), _cgroup_headroom()]
    known = [n for n in found if n is not None]
    return min(known) if known else None


def require(what: str, need: int, fix: str, device: torch.device) -> None:
    """Raise MemoryShortError when `need` bytes exceed the device's free memory. `what` starts with the setting that
    sized the allocation and names it ("engine.max_batch_size=100000: the auto policy's calibration (...)"); `fix`
    says what to change."""
    free = free_bytes(device)
    if free is not None and need > free:
        raise MemoryShortError(f"{what} needs at least {need / GIB:.1f} GiB and the {device.type} device has "
                               f"{free / GIB:.1f} GiB free; {fix}")


def _meminfo_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> Optional[int]:
    """cgroup v2: memory.max less memory.current of this process's group (None: no limit, or not cgroup v2)."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().split("\n")[0].split("::", 1)[1]
        base = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text().strip())
    except (OSError, ValueError, IndexError):
        return None
