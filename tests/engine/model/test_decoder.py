"""The direct decoder forward (esp_worker.model.decoder) gives bitwise the hidden states of the model's own forward."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine_helpers import ARCHS, reference, run, tiny
from esp_worker import EngineConfig, GenerationParams, kv_cache
from esp_worker.model.decoder import FEW_ROWS, direct_decoder, weight_major_linear
from esp_worker.model.attention import attention_bias
from esp_worker.model.runner import ModelRunner


def _runners(arch: str, attn: str) -> tuple[ModelRunner, ModelRunner]:
    lm = tiny(arch, attn)
    direct = ModelRunner(lm)
    hf = ModelRunner(dataclasses.replace(lm, direct_forward=False))
    return direct, hf


def _passes(runner: ModelRunner, seed: int) -> list[torch.Tensor]:
    """Hidden states of a padded prefill, a tree block with a bias and a plain pass without one."""
    g = torch.Generator().manual_seed(seed)
    b, s, layers = 3, 9, runner.model.config.num_hidden_layers
    cache = kv_cache.new_cache(layers)
    cache.reserve(b, s + 8)
    cache.add_rows(b)
    ids = torch.randint(3, 200, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, -1)
    lens = torch.tensor([s, s - 3, s - 5])
    key_ok = torch.arange(s)[None] < lens[:, None]
    visible = torch.ones((s, s), dtype=torch.bool).tril()[None] & key_ok[:, None, :] | torch.eye(s, dtype=torch.bool)[None]
    cache.plan(0, b, s, 0)
    outs = [runner.forward(runner.embed_ids(ids), attention_bias(visible, None, pos, s, runner.dtype), pos, cache, s - 1)]
    # a tree block: root, two children of the root, a grandchild of the first (per-row cache lengths)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)[None]
    q = 4
    qpos = lens[:, None] + torch.tensor([0, 1, 1, 2])[None]
    cache.plan(0, b, s + q, lens)
    bias = attention_bias(tree, lens, qpos, s + q, runner.dtype, runner.sliding_window)
    outs.append(runner.forward(runner.embed_ids(torch.randint(3, 200, (b, q), generator=g)), bias, qpos, cache, s + 2))
    # plain decoding of rows of one length: no bias
    cache.plan(0, b, s + 1, s)
    one = torch.full((b, 1), s)
    outs.append(runner.forward(runner.embed_ids(torch.randint(3, 200, (b, 1), generator=g)), None, one, cache, s))
    return outs


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_direct_forward_is_bitwise_the_model_forward(arch, attn):
    direct, hf = _runners(arch, attn)
    assert direct.direct is not None and hf.direct is None and direct.direct.fast_rope
    for a, b in zip(_passes(direct, 0), _passes(hf, 0)):
        assert torch.equal(a, b)
    direct.direct.fast_rope = False  # the architecture's own apply_rotary_pos_emb (rotary types it cannot take)
    for a, b in zip(_passes(direct, 0), _passes(hf, 0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_keep_rows_is_bitwise_the_full_forward(arch):
    """`keep` (the prefill's last prompt token and the masks after it) skips the last layer's work at the other
    positions: the kept hidden states and every layer's cached keys and values are bitwise the full forward's."""
    direct, hf = _runners(arch, "sdpa")
    # Where the start-up probe finds products of >= 4 rows round each row alike (a property of the machine's
    # matrix kernels), the last layer computes only the kept rows and they are bitwise the full forward's;
    # elsewhere it selects them from the full computation. On a machine of the second kind the first is forced
    # as well, so its row bookkeeping is checked everywhere (to rounding, there).
    probed = direct.direct.rows_invariant
    for forced in [False] if probed else [False, True]:
        direct.direct.rows_invariant = probed or forced
        g = torch.Generator().manual_seed(1)
        for case in _KEEP_CASES:
            kept, hf_kept, expect, slab_kept, slab = _kept_and_full(direct, hf, case, g)
            assert kept.shape == expect.shape and torch.equal(hf_kept, expect) and torch.equal(slab_kept, slab)
            if forced:
                torch.testing.assert_close(kept, expect, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(kept, expect)


_KEEP_CASES = [  # batch, length, prompt lengths, kept positions
    (3, 9, [7, 5, 3], [[6, 7, 8], [4, 7, 8], [2, 7, 8]]),  # padded prompts, then two masks (bias)
    (1, 12, [12], [[11]]),  # one prompt, no bias: padded to a product of 4 rows inside
    (2, 6, [6, 6], [[5], [5]]),
]


def _kept_and_full(direct: ModelRunner, hf: ModelRunner, case: tuple, g: torch.Generator) -> tuple:
    """A prefill with `keep` (direct and the model's own forward), the kept rows of the full one, and the slabs."""
    b, s, lens, keep = case
    layers = direct.model.config.num_hidden_layers
    ids = torch.randint(3, 200, (b, s), generator=g)
    pos = torch.arange(s)[None].expand(b, -1)
    lens_t = torch.tensor(lens)
    i = torch.arange(s)
    key_ok = (i[None] < lens_t[:, None]) | (i[None] >= max(lens) if len(keep[0]) > 1 else i[None] < 0)
    visible = torch.ones((s, s), dtype=torch.bool).tril()[None] & key_ok[:, None, :] | torch.eye(s, dtype=torch.bool)[None]
    bias = None if min(lens) == s else attention_bias(visible, None, pos, s, direct.dtype)
    outs = []
    for runner, k in [(direct, None), (direct, torch.tensor(keep)), (hf, torch.tensor(keep))]:
        cache = kv_cache.new_cache(layers)
        cache.reserve(b, s)
        cache.plan(0, b, s, 0)
        h = runner.forward(runner.embed_ids(ids), bias, pos, cache, s - 1, keep=k)
        outs.append((h, cache.slab.clone()))
    (full, slab), (kept, slab_kept), (hf_kept, _) = outs
    expect = full.gather(1, torch.tensor(keep)[..., None].expand(-1, -1, full.shape[-1]))
    return kept, hf_kept, expect, slab_kept, slab


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: projections with biases
def test_few_row_products_are_close_and_leave_the_decoder_bitwise(arch):
    """DMTD's refill runs its layers through `few_rows()`: products of 2 .. FEW_ROWS rows weight-major, which
    round differently from F.linear (close, not equal); other row counts, and the decoder itself, stay bitwise."""
    direct, hf = _runners(arch, "sdpa")
    dec = direct.direct
    layer, g = dec.qkv[0], torch.Generator().manual_seed(0)
    assert layer.bias is not None or arch == "llama"
    for m in (1, 2, 3, FEW_ROWS, FEW_ROWS + 1, 16):
        x = torch.randn((1, m, layer.weight.shape[1]), generator=g)
        ref, got = F.linear(x, layer.weight, layer.bias), weight_major_linear(x, layer)
        assert got.shape == ref.shape and got.is_contiguous()
        if 2 <= m <= FEW_ROWS:
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, ref)
    few = dec.few_rows()  # a view: the decoder keeps its own products
    assert few is not dec and few.linear is weight_major_linear and dec.linear is not weight_major_linear
    direct.direct = few  # a prefill of 27 rows, a tree block of 12 and a plain pass of 3 (weight-major)
    for a, b in zip(_passes(direct, 0), _passes(hf, 0)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    direct.direct = dec
    for a, b in zip(_passes(direct, 0), _passes(hf, 0)):
        assert torch.equal(a, b)


def test_unsupported_architecture_falls_back():
    lm = tiny("llama")
    base = ModelRunner(lm).base
    old = base.config.model_type
    try:
        base.config.model_type = "gpt2"
        assert direct_decoder(base) is None
    finally:
        base.config.model_type = old


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rotary_table_grows_and_equals_the_module(arch):
    direct = ModelRunner(tiny(arch)).direct
    x = torch.zeros(1, 1, direct.base.config.hidden_size)
    g = torch.Generator().manual_seed(3)
    for bound in (5, 300, 1000):  # the table starts at 256 positions and grows past them
        pos = torch.randint(0, bound + 1, (3, 7), generator=g)
        table = direct.rotary_table(bound, x)
        ref_cos, ref_sin = direct.base.rotary_emb(x, position_ids=pos)
        assert torch.equal(table.cos[pos], ref_cos) and torch.equal(table.sin[pos], ref_sin)
        # the factors `run` takes: from the table's rows where the positions are bounded, the module's where not
        for got, ref in zip(direct.rope(x, pos, bound), direct.rope(x, pos)):
            assert torch.equal(got, ref)
    assert table.cos.shape[0] == 1024


def test_fused_projections_keep_the_model_parameters():
    lm = tiny("qwen2")  # q/k/v with biases
    attn = lm.model.get_decoder().layers[0].self_attn
    before = [t.clone() for t in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.bias)]
    ModelRunner(lm)
    after = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.bias)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_without_bias_is_causal(arch):
    """A prefill of prompts of one length passes no mask (SDPA's is_causal): same hidden states as the causal bias."""
    runner = ModelRunner(tiny(arch))
    assert runner.causal_without_bias
    b, s = 2, 12
    ids = torch.randint(3, 200, (b, s), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(s)[None].expand(b, -1)
    causal = torch.ones((s, s), dtype=torch.bool).tril()[None]
    outs = []
    for bias in (attention_bias(causal, None, pos, s, runner.dtype), None):
        cache = kv_cache.new_cache(runner.model.config.num_hidden_layers)
        cache.reserve(b, s)
        cache.add_rows(b)
        cache.plan(0, b, s, 0)
        outs.append(runner.forward(runner.embed_ids(ids), bias, pos, cache, s - 1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not ModelRunner(tiny(arch, "eager")).causal_without_bias  # eager attention needs the mask


@pytest.mark.parametrize("b,q,s,g", [(16, 2, 300, 4), (1, 30, 230, 4), (3, 9, 9, 2), (2, 200, 200, 4)])
def test_packed_gqa_attention_is_bitwise_transformers_sdpa(b, q, s, g):
    """Grouped-query heads packed into the query dimension (no copy of the cache per query head) give
    transformers' sdpa attention with repeated keys and values to within 2 float32 ulps; the last case
    (g * Q > 2 * H * hd) takes transformers' own path. Each query row sees the same keys in the same order, and
    on the CPUs of earlier sessions the results were bitwise equal at all four shapes; on an AVX512 CPU the
    kernel accumulates a block of g * Q query rows in another order than a block of Q at two of them (up to
    2.1e-7 here)."""
    from types import SimpleNamespace

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from esp_worker.model.decoder import sdpa_packed_gqa

    gen = torch.Generator().manual_seed(b * q)
    hkv, hd = 2, 8
    module = SimpleNamespace(num_key_value_groups=g, is_causal=True, training=False)
    cache = torch.randn((b, hkv, s + 16, hd), generator=gen)
    k, v = cache[:, :, :s], torch.randn((b, hkv, s, hd), generator=gen)  # k: a view of a larger buffer, as the cache
    query = torch.randn((b, q, hkv * g, hd), generator=gen).transpose(1, 2)  # [B, H, Q, hd] as the decoder makes it
    hidden = torch.rand((b, 1, q, s), generator=gen) < 0.3
    hidden[..., 0] = False  # every query sees at least one key
    bias = torch.zeros((b, 1, q, s)).masked_fill_(hidden, torch.finfo(torch.float32).min)
    want, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, k, v, bias, dropout=0.0, scaling=0.3)
    got, _ = sdpa_packed_gqa(module, query, k, v, bias, scaling=0.3)
    assert got.shape == want.shape == (b, q, hkv * g, hd)
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp(min=1.0)
    assert ((got - want).abs() <= 2 * ulp).all(), (got - want).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_norms_run_fused_with_the_module_numbers(arch):
    """In bfloat16 the module's RMSNorm (float32 upcast, round, then the weight: eight operations) runs as
    `F.rms_norm` on the half input and the weight's product (two: a replayed pass is bound by its kernel count),
    with the module's numbers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import copy

    shared = tiny(arch)  # cached and shared with other tests: changed only as a copy
    lm = dataclasses.replace(shared, model=copy.deepcopy(shared.model).to(torch.bfloat16))
    layer = lm.model.get_decoder().layers[0]
    with torch.no_grad():
        layer.input_layernorm.weight.normal_()
    fused, module = ModelRunner(lm).direct.norms[0][0], layer.input_layernorm
    assert fused != module.forward
    x = torch.randn(4, 3, lm.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.bfloat16) * 4
    ops = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Ops():  # as the engine runs it (with autograd on, rms_norm decomposes)
        out = fused(x)
    assert ops == ["rms_norm", "mul"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, module.forward(x))


def test_attention_backend_restricts_decode_passes_not_prefill(monkeypatch):
    """engine.attention_backend=math: a decode pass's attention (keys beyond the block) runs under
    sdpa_kernel([MATH]), bitwise the math kernel's result; a prefill (keys = the block) keeps torch's choice."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel

    from esp_worker.model import decoder

    gen = torch.Generator().manual_seed(3)
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    k, v = torch.randn((2, 2, 40, 8), generator=gen), torch.randn((2, 2, 40, 8), generator=gen)
    query = torch.randn((2, 4, 3, 8), generator=gen)  # [B, H, Q, hd]
    bias = torch.zeros((2, 1, 3, 40))
    bias[..., 30:] = torch.finfo(torch.float32).min
    backends = decoder.attention_backends("math")
    got, _ = decoder.sdpa_packed_gqa(module, query, k, v, bias, scaling=0.3, backends=backends)
    with sdpa_kernel([SDPBackend.MATH]):
        want, _ = decoder.sdpa_packed_gqa(module, query, k, v, bias, scaling=0.3)
    assert torch.equal(got, want)
    assert decoder.attention_backends("torch") is None
    seen = []
    monkeypatch.setattr(decoder, "sdpa_kernel", lambda b: seen.append(b) or sdpa_kernel(b))
    decoder.sdpa_packed_gqa(module, query, k[:, :, :3], v[:, :, :3], bias[..., :3], scaling=0.3, backends=backends)
    assert seen == []  # prefill
    decoder.sdpa_packed_gqa(module, query, k, v, bias, scaling=0.3, backends=backends)
    assert seen == [backends]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_math_attention_is_generate(arch):
    """The engine's tokens under engine.attention_backend=math are generate's (float32), drafting and batched."""
    cfg = EngineConfig(method="esp", num_masks=1, block_complexity=10, max_batch_size=2, attention_backend="math")
    outs = run(tiny(arch), cfg, GenerationParams(max_new_tokens=24))
    assert [tuple(o.token_ids) for o in outs] == list(reference(arch, "sdpa", 24))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_grouped_query_bias_is_tiled_once_per_forward(arch):
    """A biased decode block tiles its bias for the packed grouped-query heads once for all layers, not per layer
    (one kernel fewer per layer in a replayed pass), and the hidden states stay the model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    direct, hf = _runners(arch, "sdpa")
    cfg = direct.model.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    assert g > 1 and cfg.num_hidden_layers > 1
    b, s, q = 3, 9, 4
    tiled = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (b, 1, g * q, s + q):
                tiled.append(func.overloadpacket.__name__)
            return out

    with torch.inference_mode(), Shapes():
        _passes(direct, 0)
    assert len(tiled) == 1  # expand().reshape(): one copy for all the tree block's layers
    for a, want in zip(_passes(direct, 0), _passes(hf, 0)):
        assert torch.equal(a, want)
