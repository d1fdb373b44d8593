"""Engine behaviour: KV keep, prompt lookup, stopping, bad requests, statistics, continuous batching."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from engine_helpers import PROMPTS, reference, run, tiny
from esp_worker import Engine, EngineConfig, GenerationParams, Request, RequestStats
from esp_worker import kv_cache
from esp_worker.batch import drop_order
from esp_worker.drafters.pld import PromptLookupDrafter


def _slab(rows, slots, fill):
    """A 1-layer KVCache with H = D = 1 whose key at (row, slot) is fill(row, slot); values = keys + 100."""
    cache = kv_cache.new_cache(1)
    cache.reserve(rows, slots)
    cache.plan(0, rows, slots, 0)
    keys = torch.tensor([[fill(r, s) for s in range(slots)] for r in range(rows)], dtype=torch.float32)
    cache.update(keys[:, None, :, None], keys[:, None, :, None] + 100, 0)
    cache.add_rows(rows)
    return cache


def test_kv_keep_packs_accepted_slots_per_row():
    cache = _slab(2, 10, lambda r, s: s)  # slot value = slot index so moves are visible
    # cache_len [3, 5]; a pass of Q = 4 wrote row 0 at slots 3..6 and row 1 at 5..8. Row 0 keeps the root and
    # the node at block index 2 (slots 3, 5); row 1 keeps the root only (its second move is a no-op).
    cache.keep(torch.tensor([[3, 4], [5, 6]]), torch.tensor([[3, 5], [5, 6]]))
    k = cache.layers[0].keys[:2, 0, :7, 0]
    assert k.tolist() == [[0, 1, 2, 3, 5, 5, 6], [0, 1, 2, 3, 4, 5, 6]]
    assert cache.layers[0].values[0, 0, :5, 0].tolist() == [100, 101, 102, 103, 105]


def test_kv_keep_to_one_run_of_slots_and_for_one_row_is_the_general_move():
    """keep(d, src) (rows of one length: the path lands at slots d ..) and a batch of one row (an index instead of
    a gather) move exactly what keep(dst [B, P], src) moves, reading every source before writing."""
    for rows, src in ((2, [[4, 6], [4, 8]]), (1, [[5, 4]])):
        want, got = _slab(rows, 10, lambda r, s: 10 * r + s), _slab(rows, 10, lambda r, s: 10 * r + s)
        want.keep(torch.tensor([[5, 6]] * rows), torch.tensor(src))
        got.keep(5, torch.tensor(src))
        for a, b in ((want.layers[0].keys, got.layers[0].keys), (want.layers[0].values, got.layers[0].values)):
            assert torch.equal(a[:rows], b[:rows])
        assert got.layers[0].keys[0, 0, 5:7, 0].tolist() == [float(x) for x in src[0]]


def test_kv_block_written_in_place_per_row():
    cache = _slab(2, 8, lambda r, s: 0)
    cache.plan(0, 2, 6, torch.tensor([2, 4]))  # rows write their Q = 2 new slots at 2..3 and 4..5
    new = torch.tensor([[1.0, 2.0], [3.0, 4.0]])[:, None, :, None]
    k, _ = cache.update(new, new, 0)
    assert k.shape == (2, 1, 6, 1)
    assert k[:, 0, :, 0].tolist() == [[0, 0, 1, 2, 0, 0], [0, 0, 0, 0, 3, 4]]


def test_kv_select_rows_compacts_and_capacity_stays_bounded():
    cache = _slab(3, 40, lambda r, s: r)
    cache.select_rows([2, 0])
    assert cache.num_rows == 2 and cache.layers[0].keys[:2, 0, 0, 0].tolist() == [2, 0]
    cache.reserve(4, 40)  # two more rows join: rows 0..1 and their slots survive the growth
    assert cache.layers[0].keys.shape[0] == 4 and cache.layers[0].keys[:2, 0, 39, 0].tolist() == [2, 0]
    for n in (100, 1000, 5000):
        assert n <= kv_cache.bucket(n) <= 1.125 * n + 16
    cache.reserve(1, 40)  # one live row: the buffers shrink to it
    assert cache.nbytes() == 2 * 1 * kv_cache.bucket(40) * 4


def test_kv_growth_zeroes_what_it_did_not_copy():
    """Grown buffers are allocated uninitialised: the kept part is copied, every other slot and row must be zero
    (stale slots are masked by an additive bias, and 0 * NaN would be NaN)."""
    cache = _slab(2, 20, lambda r, s: 1 + r * 100 + s)
    torch.full((4, 1, 2048, 1), float("nan"))  # leave garbage in the allocator's free memory
    cache.reserve(3, 100)
    keys = cache.layers[0].keys  # [R, H, C, D]
    c20 = kv_cache.bucket(20)
    assert keys.shape[0] == 3 and keys.shape[2] == kv_cache.bucket(100)
    assert keys[:2, 0, :20, 0].tolist() == [[1 + r * 100 + s for s in range(20)] for r in range(2)]
    assert torch.count_nonzero(keys[:2, :, c20:]) == 0 and torch.count_nonzero(keys[2]) == 0


def test_pinned_slab_whose_growth_is_refused_spills_the_live_rows_then_takes_them_back():
    """A pinned slab grows for all its rows; where that is refused (MemoryShortError) the live rows move into buffers
    of their own and the slab stays for the graphs that read it; they move back once they fit it. A growth refused
    for the live rows too leaves the cache as it was."""
    from esp_worker.memory import MemoryShortError

    cache = kv_cache.new_cache(1)
    cache.pin(4, 16, 1, 1, torch.float32, torch.device("cpu"))
    pinned = cache.slab
    keys = torch.arange(2 * 16, dtype=torch.float32).reshape(2, 1, 16, 1)
    cache.plan(0, 2, 16, 0)
    with torch.inference_mode():  # the pinned slab is an inference tensor, as the engine's passes are
        cache.update(keys, keys + 100, 0)
    cache.add_rows(2)
    budget = 100  # slots x rows

    def refuse(rows, slots):
        if rows * slots > budget:
            raise MemoryShortError(f"{rows} x {slots}")

    cache.before_growth = refuse
    cache.reserve(2, 40)  # 4 x 48 refused, 2 x 48 fits
    assert cache.spilled and cache.pinned_slab is pinned and cache.slab is not pinned
    assert cache.layers[0].keys.shape == (2, 1, kv_cache.bucket(40), 1) and pinned.shape == (1, 2, 4, 1, 16, 1)
    assert torch.equal(cache.layers[0].keys[:, :, :16], keys) and torch.equal(cache.layers[0].values[:, :, :16], keys + 100)
    assert cache.nbytes() == (2 * 48 + 4 * 16) * 2 * 4
    cache.plan(0, 2, 41, 16)
    with torch.inference_mode():
        cache.update(torch.full((2, 1, 25, 1), 7.0), torch.full((2, 1, 25, 1), 7.0), 0)  # slots 16 .. 40
    with pytest.raises(MemoryShortError):
        cache.reserve(2, 60)  # 2 x 64 refused too: nothing changes
    assert cache.layers[0].keys.shape[2] == kv_cache.bucket(40) and cache.layers[0].keys[0, 0, 40, 0] == 7
    cache.select_rows([1])
    cache.reserve(1, 12)  # the row fits the slab again: back in it, its slots with it
    assert not cache.spilled and cache.slab is pinned and cache.capacity == (4, 16)
    assert torch.equal(cache.layers[0].keys[0, 0, :, 0], keys[1, 0, :, 0]) and cache.layers[0].values[0, 0, 3, 0] == 119
    cache.before_growth = None
    cache.reserve(2, 40)  # room enough: the pinned slab itself grows, for all its rows
    assert not cache.spilled and cache.slab.shape == (1, 2, 4, 1, 48, 1)


def test_drop_order_moves_only_rows_that_must_move():
    assert drop_order(6, [1, 4]) == [0, 5, 2, 3]  # hole 1 takes row 5; hole 4 is past the new size
    assert drop_order(5, [0]) == [4, 1, 2, 3]
    assert drop_order(4, [2, 3]) == [0, 1] and drop_order(3, [0, 1, 2]) == [] and drop_order(3, []) == [0, 1, 2]
    cache = _slab(4, 8, lambda r, s: r)
    before = cache.slab.clone()
    cache.select_rows(drop_order(4, [1]))  # row 3 moves to row 1; rows 0 and 2 are not copied
    assert cache.num_rows == 3 and cache.layers[0].keys[:3, 0, 0, 0].tolist() == [0, 3, 2]
    assert torch.equal(cache.slab[:, :, 3], before[:, :, 3])  # row 3's old place is left as it was


def test_kv_slab_shared_by_layers_of_one_shape_and_own_buffers_for_another():
    """Layers 0 and 1 (D = 1) live in one slab, layer 2 (D = 2) has its own buffers; keep, select_rows and growth
    move every layer's keys and values alike."""
    cache = kv_cache.new_cache(3)
    rows, slots = 3, 12
    cache.reserve(rows, slots)
    cache.plan(0, rows, slots, 0)
    base = torch.arange(rows * slots, dtype=torch.float32).reshape(rows, 1, slots, 1)  # [B, H, S, 1]
    for i, d in enumerate((1, 1, 2)):
        k = (base + 1000 * i).expand(-1, -1, -1, d)
        cache.update(k, k + 100, i)
    cache.add_rows(rows)
    layers = cache.layers
    assert layers[0].in_slab and layers[1].in_slab and not layers[2].in_slab
    assert cache.slab.shape[:2] == (3, 2) and layers[1].keys.data_ptr() != layers[0].keys.data_ptr()

    def snapshot():  # [layer][k/v] -> [rows, slots] (first feature)
        return [[t[: cache.num_rows, 0, :slots, 0].clone() for t in (l.keys, l.values)] for l in layers]

    expect = snapshot()
    cache.keep(torch.tensor([[4, 5], [2, 3], [7, 8]]), torch.tensor([[4, 9], [2, 3], [7, 10]]))
    for layer in expect:
        for t in layer:
            t[0, 5], t[2, 8] = t[0, 9].clone(), t[2, 10].clone()
    assert all(torch.equal(a, b) for la, lb in zip(snapshot(), expect) for a, b in zip(la, lb))
    cache.select_rows([2, 0])
    expect = [[t[[2, 0]] for t in layer] for layer in expect]
    assert all(torch.equal(a, b) for la, lb in zip(snapshot(), expect) for a, b in zip(la, lb))
    cache.reserve(5, 40)  # growth keeps the live rows and slots of every layer, the slab views follow
    assert layers[0].keys.shape == (5, 1, kv_cache.bucket(40), 1) and layers[0].keys.data_ptr() == cache.slab.data_ptr()
    assert all(torch.equal(a, b) for la, lb in zip(snapshot(), expect) for a, b in zip(la, lb))
    assert layers[2].keys[:2, 0, :slots, 1].equal(expect[2][0])  # layer 2's second feature moved too


@pytest.mark.parametrize(
    "hist,n_max,n_min,expected",
    [
        ([5, 6, 7, 8, 5, 6], 2, 1, [7, 8, 5]),  # 2-gram [5 6] at 0 -> what followed
        ([5, 6, 7, 5, 9, 6], 2, 1, [7, 5, 9]),  # no 2-gram match; 1-gram [6] at 1
        ([1, 2, 3, 4], 3, 1, []),  # nothing repeats
        ([4, 1, 4, 2, 4], 1, 1, [2, 4]),  # latest earlier match of [4] is at 2
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 2, [8, 1, 2]),  # latest of two 2-gram matches wins
    ],
)
def test_prompt_lookup_proposals(hist, n_max, n_min, expected):
    d = PromptLookupDrafter(n_max, n_min, depth=3)
    h = torch.tensor([hist + [0, 0]])  # padded capacity
    start = d.find_continuation(h, torch.tensor([len(hist)]))
    got = [] if start.item() < 0 else hist[start.item(): start.item() + 3]
    assert got == expected


def test_max_new_tokens_exact_with_truncated_pass():
    lm = tiny("llama")
    ref = reference("llama", "sdpa")
    for n in (1, 2, 7, 13):
        outs = run(lm, EngineConfig(method="pld", block_complexity=11, max_batch_size=2), GenerationParams(max_new_tokens=n))
        for o, r in zip(outs, ref):
            assert tuple(o.token_ids) == r[:n]
            assert len(o.token_ids) == min(n, len(r))
            if len(r) >= n and r[n - 1] not in lm.eos_token_ids:
                assert o.finish_reason == "length"


def test_stop_strings_end_generation():
    lm = tiny("llama")
    ref = run(lm, EngineConfig(method="ar"), GenerationParams(max_new_tokens=40))
    text = ref[0].text
    stop = text[10:13]
    outs = run(lm, EngineConfig(method="esp", num_masks=2, block_complexity=30), GenerationParams(max_new_tokens=40, stop_strings=[stop]))
    o = outs[0]
    assert o.finish_reason == "stop"
    assert stop in o.text and o.text.index(stop) + len(stop) >= len(o.text) - 4
    assert ref[0].token_ids[: len(o.token_ids)] == o.token_ids


def test_context_limit_finishes_with_context():
    lm = dataclasses.replace(tiny("qwen2"), max_context=30)
    ref = reference("qwen2", "sdpa")
    outs = run(lm, EngineConfig(method="esp", num_masks=2, block_complexity=30, max_batch_size=4), GenerationParams(max_new_tokens=64))
    for prompt, o, r in zip(PROMPTS, outs, ref):
        n_prompt = len(lm.tokenizer(prompt).input_ids)
        if n_prompt >= 30:
            assert o.error and "context" in o.error
            continue
        assert tuple(o.token_ids) == r[: 30 - n_prompt]
        assert o.finish_reason == "context" or o.token_ids[-1] in lm.eos_token_ids


@pytest.mark.parametrize(
    "req,needle",
    [
        (Request(id="e", prompt=""), "empty prompt"),
        (Request(id="n"), "no prompt"),
        (Request(id="w", prompt=123), "must be a string"),
        (Request(id="l", prompt="a" * 2000), "context"),
        (Request(id="t", prompt="hi", params=GenerationParams(temperature=-1.0)), "temperature"),
        (Request(id="ti", prompt="hi", params=GenerationParams(temperature=float("inf"))), "finite"),
        (Request(id="p", prompt="hi", params=GenerationParams(top_p=0.0)), "top_p"),
        (Request(id="p2", prompt="hi", params=GenerationParams(top_p=1.5)), "top_p"),
        (Request(id="m", prompt="hi", params=GenerationParams(max_new_tokens=0)), "max_new_tokens"),
        (Request(id="k", prompt="hi", params=GenerationParams(top_k=-3)), "top_k"),
        (Request(id="s", prompt="hi", params=GenerationParams(temperature=1.0, seed=1 << 70)), "64 bits"),
        (Request(id="u", prompt="bad \ud800 surrogate"), "tokenized"),
        (Request(id="v", prompt_ids=[0, 99999]), "token ids"),
        (Request(id="g", prompt="hi", params=GenerationParams(n=2)), "temperature > 0"),
        (Request(id="n0", prompt="hi", params=GenerationParams(n=0, temperature=1.0)), "n=0"),
        (Request(id="nn", prompt="hi", params=GenerationParams(n=3, temperature=1.0)), "sample_requests"),
    ],
)
def test_bad_requests_get_errors_and_batch_goes_on(req, needle):
    lm = tiny("llama")
    eng = Engine(lm, EngineConfig(method="esp", max_batch_size=2))
    good = Request(id="ok", prompt="Hello there", params=GenerationParams(max_new_tokens=8))
    outs = eng.generate([good, req, Request(id="ok2", prompt="Another", params=GenerationParams(max_new_tokens=8))])
    assert outs[0].error is None and len(outs[0].token_ids) == 8
    assert outs[2].error is None and len(outs[2].token_ids) == 8
    assert outs[1].error is not None and needle in outs[1].error, outs[1].error
    assert "\n" not in outs[1].error


def test_continuous_batching_refills_slots():
    """More requests than slots, mixed lengths: every output equals its own single-request run."""
    lm = tiny("mistral")
    cfg = EngineConfig(method="esp", num_masks=1, block_complexity=10, max_batch_size=3)
    reqs = [Request(id=str(i), prompt=PROMPTS[i % 4] * (1 + i % 3), params=GenerationParams(max_new_tokens=5 + 7 * i))
            for i in range(9)]
    eng = Engine(lm, cfg)
    order = [o.id for o in eng.generate_iter(reqs)]
    assert sorted(order) == sorted(r.id for r in reqs)
    batched = {o.id: o.token_ids for o in Engine(lm, cfg).generate(reqs)}
    for r in reqs:
        single = Engine(lm, dataclasses.replace(cfg, max_batch_size=1)).generate([r])[0]
        assert batched[r.id] == single.token_ids
        assert len(single.token_ids) == r.params.max_new_tokens or single.finish_reason == "stop"


def test_statistics_are_consistent():
    lm = tiny("llama")
    outs = run(lm, EngineConfig(method="pld", block_complexity=11), GenerationParams(max_new_tokens=64))
    total = RequestStats()
    for o in outs:
        st = o.stats
        assert st.num_generated_tokens == len(o.token_ids)
        assert st.num_decode_tokens == st.num_generated_tokens - 1  # prefill commits the first token
        assert sum(st.committed_histogram) == st.num_decode_passes
        assert sum(n * c for n, c in enumerate(st.committed_histogram)) == st.num_decode_tokens
        assert st.num_accepted_drafts == st.num_decode_tokens - st.num_decode_passes or o.finish_reason != "length"
        assert (st.accepted_per_depth[0] if st.accepted_per_depth else 0) <= st.num_decode_passes
        assert sum(st.accepted_per_depth) == st.num_accepted_drafts
        assert st.num_accepted_drafts <= st.num_drafted_tokens
        assert sum(st.block_size_histogram.values()) == st.num_decode_passes
        assert st.num_prompt_tokens > 0 and st.time_s > 0
        total = total.merge(st)
    assert total.num_decode_passes == sum(o.stats.num_decode_passes for o in outs)
    assert total.tau == pytest.approx(total.num_decode_tokens / total.num_decode_passes)


def test_rows_that_finish_together_are_read_once(monkeypatch):
    """Retiring rows reads their tokens and counters in one device read, however many finish (on a GPU a read is a
    round trip: four per row, read apart, cost a batch of finishing rows milliseconds); the hybrid's per-proposer
    counts and the statistics come out as read apart."""
    from host_reads import READS

    lm = tiny("llama")
    cfg = EngineConfig(method="hybrid", num_masks=1, block_complexity=10, max_batch_size=4)
    params = GenerationParams(max_new_tokens=12, ignore_eos=True)
    seen = {"inside": False, "reads": 0}
    for name in READS:
        def wrapped(self, *a, _orig=getattr(torch.Tensor, name), **kw):
            seen["reads"] += seen["inside"]
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    retire = Engine._retire

    def counted(self, rows):
        done = sum(map(bool, rows.done))
        seen["inside"], before = True, seen["reads"]
        try:
            yield from retire(self, rows)
        finally:
            seen["inside"] = False
        if done:
            seen.setdefault("retires", []).append((done, seen["reads"] - before))

    monkeypatch.setattr(Engine, "_retire", counted)
    outs = run(lm, dataclasses.replace(cfg, method="ar"), params)
    assert seen.pop("retires") == [(4, 1)]  # plain decoding: the four rows end at one pass
    assert [tuple(o.token_ids) for o in outs] == [r[:12] for r in reference("llama", "sdpa")]
    outs = run(lm, cfg, params)
    assert all(reads == 1 for _, reads in seen["retires"]) and sum(n for n, _ in seen["retires"]) == 4
    assert [tuple(o.token_ids) for o in outs] == [r[:12] for r in reference("llama", "sdpa")]
    for o in outs:
        st = o.stats
        assert st.num_generated_tokens == 12 and sum(st.committed_histogram) == st.num_decode_passes
        assert sum(st.accepted_by_proposer.values()) == st.num_accepted_drafts


def test_engine_never_imports_ray():
    code = "import sys, esp_worker, esp_worker.engine, esp_worker.drafters, esp_worker.model.load; " \
           "import esp_worker.drafters.esp, esp_worker.drafters.pld; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_flash_attention_refused_with_one_line():
    from esp_worker import ModelConfig
    from esp_worker.model.errors import ModelLoadError
    from esp_worker.model.load import load_model

    with pytest.raises(ModelLoadError, match="tree attention mask"):
        load_model(ModelConfig(name_or_path="tiny-random-llama", attn_implementation="flash_attention_2"))
    with pytest.raises(ValueError, match="engine.method"):
        EngineConfig(method="nope").validate()


@pytest.mark.parametrize("cfg", [
    dict(method="ar"), dict(method="pld", block_complexity=11), dict(method="esp", num_masks=1, block_complexity=30),
    dict(method="hybrid", num_masks=1, block_complexity=30),
], ids=lambda c: c["method"])
def test_per_pass_committed_tokens_in_order_and_drafts_counted(monkeypatch, cfg):
    """committed_per_pass is each decode pass's kept tokens, in order (as the pass settled them on the device),
    for rows that join a running batch too; num_drafts counts the passes that fed the row a draft token."""
    lm = tiny("llama")
    seen: dict[str, list[int]] = {}
    settle = Engine._settle

    def recording(self, rows, block, out):
        settled = settle(self, rows, block, out)
        for s, n in zip(rows.seqs, settled.num_kept.tolist()):
            seen.setdefault(s.req.id, []).append(n)
        return settled

    monkeypatch.setattr(Engine, "_settle", recording)
    outs = run(lm, EngineConfig(max_batch_size=2, **cfg), GenerationParams(max_new_tokens=40))  # 4 prompts, 2 slots
    for o in outs:
        st = o.stats
        assert st.committed_per_pass == seen.get(o.id, [])
        assert len(st.committed_per_pass) == st.num_decode_passes
        assert sum(st.committed_per_pass) == st.num_decode_tokens
        hist = [0] * len(st.committed_histogram)
        for n in st.committed_per_pass:
            hist[n] += 1
        assert hist == st.committed_histogram
        assert 0 <= st.num_drafts <= st.num_decode_passes
        assert (st.num_drafts > 0) == (st.num_drafted_tokens > 0)
        if cfg["method"] == "ar":
            assert st.num_drafts == 0 and set(st.committed_per_pass) <= {1}
    if cfg["method"] != "ar":
        assert sum(o.stats.num_drafts for o in outs) > 0
    merged = outs[0].stats.merge(outs[1].stats)
    assert merged.committed_per_pass == outs[0].stats.committed_per_pass + outs[1].stats.committed_per_pass
    assert merged.num_drafts == outs[0].stats.num_drafts + outs[1].stats.num_drafts


def test_prefill_with_masks_runs_causal_over_prompts_of_any_lengths(monkeypatch):
    """ESP's masks sit right after each prompt and its padding after them, so a prefill of prompts of different
    lengths passes no mask tensor (SDPA's plain causal path, flash on CUDA) and each prompt's last token and masks
    get the hidden states its own prefill gives them."""
    lm = tiny("llama")
    # one forward for the four prompts: a forward's own cost worth many padded tokens
    cfg = EngineConfig(method="esp", num_masks=2, block_complexity=12, max_batch_size=4, prefill_forward_tokens=10_000)
    seen = []

    def prefills(eng):
        forward = eng.runner.forward

        def spy(embeds, bias, pos, cache, max_position=None, keep=None):
            hidden = forward(embeds, bias, pos, cache, max_position, keep=keep)
            if keep is not None:
                seen.append((bias, hidden))
            return hidden

        monkeypatch.setattr(eng.runner, "forward", spy)
        return eng

    reqs = [Request(id=str(i), prompt=p, params=GenerationParams(max_new_tokens=3)) for i, p in enumerate(PROMPTS)]
    assert len({len(lm.tokenizer(p).input_ids) for p in PROMPTS}) == len(PROMPTS)
    prefills(Engine(lm, cfg)).generate(reqs)
    (bias, together), = seen
    assert bias is None and together.shape[:2] == (4, 3)  # [R, last token + 2 masks, D]
    alone = []
    for r in reqs:
        seen.clear()
        prefills(Engine(lm, dataclasses.replace(cfg, max_batch_size=1))).generate([r])
        alone.append(seen[0][1][0])
    order = sorted(range(4), key=lambda i: -len(lm.tokenizer(PROMPTS[i]).input_ids))  # prefilled longest first
    for row, i in enumerate(order):
        assert torch.allclose(together[row], alone[i], atol=1e-5)
