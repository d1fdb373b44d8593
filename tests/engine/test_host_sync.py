"""A decode pass reads the device at most once (Rows.read_back): no .item() / .tolist() / bool() between
propose and commit. On CPU the reads are counted by wrapping the Tensor methods that copy a value to the
host; on a GPU, torch.cuda.set_sync_debug_mode("error") makes any synchronisation inside the pass raise."""
from __future__ import annotations

import contextlib

import pytest
import torch

from engine_helpers import PROMPTS, reference, run, tiny
from esp_worker import EngineConfig, GenerationParams
from esp_worker.batch import Rows
from esp_worker import engine as engine_module
from esp_worker import sampling
from esp_worker.engine import Engine

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

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


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_at_most_one_host_read_per_decode_pass(monkeypatch, setting, batch, temperature):
    monkeypatch.setattr(engine_module, "PREPARE_LOOKS", True)  # auto's looks as on an accelerator
    monkeypatch.setattr(sampling, "UNIFORM_CHUNK", 32)  # sampled rows refill their uniforms inside passes
    lm = tiny("llama")
    cfg = EngineConfig(max_batch_size=batch, **SETTINGS[setting])
    with count_reads_per_pass(monkeypatch) as seen:
        outs = run(lm, cfg, GenerationParams(max_new_tokens=32, temperature=temperature, seed=1))
    assert all(o.error is None for o in outs)
    assert seen["passes"] > 0
    # one read per pass; under block_complexity=auto the policy's look comes with the previous pass's read,
    # except right after rows joined or left (the mass it prepared was for other rows): then it reads it
    auto = SETTINGS[setting].get("block_complexity") == "auto"
    over = [(i, n, changed) for i, (n, changed) in enumerate(seen["per_pass"]) if n > 1 + (auto and changed)]
    assert not over, (over[:5], seen["where"])
    if temperature == 0:
        assert [tuple(o.token_ids) for o in outs] == [r[:32] for r in reference("llama", "sdpa")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_synchronisation_inside_a_pass_on_gpu(monkeypatch, setting, temperature):
    """Any synchronising CUDA call inside Engine._step raises, except in the pass's one Rows.read_back (and,
    under block_complexity=auto, in a pass right after rows joined or left: see the CPU test)."""
    from esp_worker import ModelConfig
    from esp_worker.model.load import load_model

    lm = load_model(ModelConfig(name_or_path="tiny-random-llama", device="cuda"))
    step, read_back = Engine._step, Rows.read_back
    inside = [False]  # read_back also runs outside a pass (prefill): strict mode only inside _step
    auto = SETTINGS[setting].get("block_complexity") == "auto"
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

    monkeypatch.setattr(Engine, "_step", strict_step)
    monkeypatch.setattr(Rows, "read_back", allowed_read_back)
    params = GenerationParams(max_new_tokens=64, temperature=temperature, seed=1)  # past a uniform refill
    try:
        outs = run(lm, EngineConfig(max_batch_size=4, **SETTINGS[setting]), params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert all(len(o.token_ids) > 0 for o in outs)
