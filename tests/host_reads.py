"""Counting a decode pass's host reads (tests/engine/test_host_sync.py, tests/engine/graphs/test_capture_path.py):
the Tensor methods that copy a value to the host, tensors made from host data on a device, Python numbers
stored at one integer index, and operations whose output's size depends on the data (on a GPU each waits for the
device to learn it: boolean-mask indexing, nonzero, unique, ...), inside Engine._step."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from esp_worker.engine import Engine

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
# operations whose output size depends on the data (repeat_interleave with a tensor of repeats: the Tensor overload)
DATA_SIZED = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
              "argwhere", "masked_scatter")


class _DataSized(TorchDispatchMode):
    """Counts the operations inside a pass whose output size depends on the data, as reads."""

    def __init__(self, seen: dict):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        sized = name in DATA_SIZED or func is torch.ops.aten.repeat_interleave.Tensor
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):  # indexing with a boolean mask
            sized = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if sized:
            self.seen["reads"] += 1
            if len(self.seen["where"]) < 5:
                import traceback
                self.seen["where"].append((name, "".join(traceback.format_stack(limit=8)[:-2])))
        return func(*args, **(kwargs or {}))

SETTINGS = [
    dict(method="ar"),
    dict(method="pld", block_complexity=10),
    dict(method="esp", num_masks=1, block_complexity=30, tree="static"),
    dict(method="esp", num_masks=2, block_complexity=30, tree="dynamic"),
    dict(method="hybrid", num_masks=1, block_complexity=30),
    dict(method="hybrid", num_masks=2, block_complexity=10),
    dict(method="stand", block_complexity=30),
    dict(method="lade", block_complexity=30),
    dict(method="lade", block_complexity=10),
    dict(method="esp", num_masks=1, block_complexity="auto"),
    dict(method="hybrid", num_masks=1, block_complexity="auto"),
    dict(method="dmtd", dmtd_tau=3, dmtd_decoding_layers=1),  # rows at their own cycle phases (not lossless)
]


@contextlib.contextmanager
def count_reads_per_pass(monkeypatch):
    """Yields a dict: passes, reads (host reads of tensor values made inside Engine._step), and per pass
    (reads, whether its rows differ from the previous pass's: rows joined or left)."""
    seen = {"passes": 0, "reads": 0, "inside": False, "where": [], "per_pass": [], "rows": None}
    for name in READS:
        orig = getattr(torch.Tensor, name)

        def wrapped(self, *a, _orig=orig, _name=name, **kw):
            if seen["inside"]:
                seen["reads"] += 1
                if len(seen["where"]) < 5:
                    import traceback
                    seen["where"].append((_name, traceback.format_stack(limit=4)[-2]))
            return _orig(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    step = Engine._step

    def counted_step(self, rows):
        seen["passes"] += 1
        ids = [s.req.id for s in rows.seqs]
        changed, seen["rows"] = ids != seen["rows"], ids
        before = seen["reads"]
        seen["inside"] = True
        try:
            with _DataSized(seen):
                return step(self, rows)
        finally:
            seen["inside"] = False
            seen["per_pass"].append((seen["reads"] - before, changed))

    monkeypatch.setattr(Engine, "_step", counted_step)
    # a tensor made from host data directly on the rows' device inside a pass is a host-to-device copy from
    # pageable memory on a GPU, which waits for the stream: it counts as a read (sampling.upload is the way)
    for name in ("tensor", "as_tensor"):
        make = getattr(torch, name)

        def counted_make(*a, _make=make, _name=name, **kw):
            if seen["inside"] and kw.get("device") is not None:
                seen["reads"] += 1
                if len(seen["where"]) < 5:
                    import traceback
                    seen["where"].append((f"torch.{_name}", traceback.format_stack(limit=4)[-2]))
            return _make(*a, **kw)

        monkeypatch.setattr(torch, name, counted_make)
    # so is a Python number stored at one integer index (`t[i] = 0`): on an H200 under torch 2.11 such a store
    # raised in sync debug mode, while stores through slices (`t[:, 0] = True`) did not; `.zero_()` / `.fill_()`
    # / torch.where keep the value on the device
    setitem = torch.Tensor.__setitem__

    def counted_setitem(self, index, value, _setitem=setitem):
        if seen["inside"] and isinstance(index, int) and isinstance(value, (bool, int, float)):
            seen["reads"] += 1
            if len(seen["where"]) < 5:
                import traceback
                seen["where"].append(("__setitem__ scalar", traceback.format_stack(limit=4)[-2]))
        return _setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", counted_setitem)
    yield seen


@contextlib.contextmanager
def strict_sync_passes(monkeypatch, auto: bool):
    """On CUDA: torch.cuda.set_sync_debug_mode("error") inside every Engine._step but its one Rows.read_back (or,
    under engine.cuda_graphs_run_ahead, its PendingRead.get of the pass before), so any other synchronisation in a
    pass raises. Under block_complexity=auto (`auto`), a pass right after rows joined or left may also read (see
    tests/engine/test_host_sync.py) and runs unchecked."""
    from esp_worker.batch import PendingRead, Rows

    step, read_back, get = Engine._step, Rows.read_back, PendingRead.get
    inside = [False]  # read_back also runs outside a pass (prefill): strict mode only inside _step
    last_rows = [None]

    def strict_step(self, rows):
        ids = [s.req.id for s in rows.seqs]
        changed, last_rows[0] = ids != last_rows[0], ids
        if auto and changed:
            return step(self, rows)
        inside[0] = True
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(self, rows)
        finally:
            inside[0] = False
            torch.cuda.set_sync_debug_mode(0)

    def allowed_read_back(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return read_back(self, *args, **kwargs)
        finally:
            if inside[0]:
                torch.cuda.set_sync_debug_mode("error")

    def allowed_get(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return get(self)
        finally:
            if inside[0]:
                torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(Engine, "_step", strict_step)
    monkeypatch.setattr(Rows, "read_back", allowed_read_back)
    monkeypatch.setattr(PendingRead, "get", allowed_get)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
