"""DMTD (model/dmtd.py): the split in the authors' config fields, PLT counting, and the consistency of the direct
mode with the training-time forward: run teacher-forced over what `engine.method=dmtd` generated, the cyclic
forward's argmax at every position is the token the engine chose there (greedy, batch 1 and 4, rows at every
cycle phase, four architectures, E = 0 and E > 0, the direct loop and the model's own modules)."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from engine_helpers import ARCHS, PROMPTS, reference, run, tiny
from esp_worker import EngineConfig, GenerationParams, ModelConfig
from esp_worker.model.dmtd import (CycleStarts, DmtdConfig, DmtdConfigError, base_model_type, cyclic_forward,
                                   resolve)
from esp_worker.model.load import build_tiny_config, build_tiny_tokenizer, load_model, sliding_window

AUTHORS_AUTO_MAP = {"AutoConfig": "configuration_mtpqwen3.MTPQwen3Config",
                    "AutoModelForCausalLM": "modeling_mtpqwen3.MTPQwen3ForCausalLM"}
# more prompts than PROMPTS, so that batch 4 refills its rows (continuous batching) and prompt lengths 1..3 mod tau
MORE = PROMPTS + ("import os\nimport sys\n", "A", "In the beginning God created the heaven and the earth.")


@functools.lru_cache(maxsize=None)
def saved_model(arch: str, tmp_root: str, split: tuple, authors: bool = False, layers: int = 4) -> str:
    """A tiny random `arch` model of `layers` layers saved with the DMTD fields (E, T, D, tau) in its config.json;
    `authors`: in the authors' format (model_type mtp<arch>, their architectures and auto_map)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    tok = build_tiny_tokenizer()
    small = build_tiny_config(arch, len(tok)).to_dict()
    small.update(num_hidden_layers=layers, initializer_range=0.2)
    small.pop("layer_types", None)  # derived from the layer count
    cfg = type(build_tiny_config(arch, len(tok)))(**small)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out = Path(tmp_root) / f"{arch}-{'-'.join(map(str, split))}-{'authors' if authors else 'ours'}"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.update(dict(zip(("num_encoding_layers", "num_thinking_layers", "num_decoding_layers", "mtp_horizon"), split)))
    if authors:
        raw.update(model_type=f"mtp{arch}", architectures=[f"MTP{arch.capitalize()}ForCausalLM"], auto_map=AUTHORS_AUTO_MAP)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    return str(out)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    torch.set_num_threads(1)  # as engine_helpers.tiny: two threads on a busy machine crawl
    return str(tmp_path_factory.mktemp("dmtd_models"))


def teacher_forced(lm, cfg: DmtdConfig, prompt_ids: list[int], out_ids: list[int]) -> list[int]:
    """The cyclic forward's greedy token at each generated position, fed the prompt and the generated tokens."""
    seq = torch.tensor([list(prompt_ids) + list(out_ids)])
    with torch.no_grad():
        h = cyclic_forward(lm.model.get_decoder(), cfg, seq, window=sliding_window(lm.model.config))
        pred = lm.model.get_output_embeddings()(h).argmax(-1)[0]
    return pred[len(prompt_ids) - 1: -1].tolist()


def check_consistent(lm, dcfg: DmtdConfig, cfg: EngineConfig, prompts=MORE, max_new: int = 40):
    outs = run(lm, cfg, GenerationParams(max_new_tokens=max_new, ignore_eos=True), prompts)
    for o, p in zip(outs, prompts):
        assert o.error is None, o.error
        ids = lm.tokenizer(p)["input_ids"]
        assert len(o.token_ids) == max_new
        assert o.token_ids == teacher_forced(lm, dcfg, ids, o.token_ids), f"prompt {p!r}: diverged from the cyclic forward"
        assert o.stats.plt == pytest.approx(dcfg.layers_run(len(ids), max_new) / ((max_new - 1) * dcfg.num_layers))
    return outs


# ---- the split -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields,layers,expected", [
    ({}, 6, None),
    ({"num_encoding_layers": 0, "num_thinking_layers": 4, "num_decoding_layers": 2, "mtp_horizon": 3}, 6, (0, 4, 2, 3)),
    ({"num_encoding_layers": 1, "num_thinking_layers": 2, "num_decoding_layers": 1, "mtp_horizon": 2}, 4, (1, 2, 1, 2)),
    ({"num_encoding_layers": 0, "num_thinking_layers": 4, "num_decoding_layers": 2, "mtp_horizon": 3}, 7, "7"),
    ({"num_decoding_layers": 2, "mtp_horizon": 3}, 6, "lacks num_encoding_layers, num_thinking_layers"),
    ({"num_encoding_layers": 0, "num_thinking_layers": 6, "num_decoding_layers": 0, "mtp_horizon": 3}, 6, "D >= 1"),
])
def test_split_from_the_authors_fields(fields, layers, expected):
    from transformers import Qwen3Config

    cfg = Qwen3Config(num_hidden_layers=layers, **fields)
    if isinstance(expected, str):
        with pytest.raises(DmtdConfigError, match=expected):
            DmtdConfig.of_model(cfg)
        return
    got = DmtdConfig.of_model(cfg)
    assert (None if got is None else tuple(got.to_dict().values())) == expected


def test_resolve_overrides_and_untrained_models():
    from transformers import LlamaConfig, GPT2Config

    own = LlamaConfig(num_hidden_layers=6, num_encoding_layers=0, num_thinking_layers=4, num_decoding_layers=2,
                      mtp_horizon=3)
    assert resolve(own) == DmtdConfig(0, 4, 2, 3)
    assert resolve(own, tau=2, num_decoding_layers=3) == DmtdConfig(0, 3, 3, 2)
    assert resolve(LlamaConfig(num_hidden_layers=6), tau=4, num_decoding_layers=2) == DmtdConfig(0, 4, 2, 4)
    with pytest.raises(DmtdConfigError, match="needs a DMTD model"):
        resolve(LlamaConfig(num_hidden_layers=6))
    with pytest.raises(DmtdConfigError, match="supports"):
        resolve(GPT2Config(), num_decoding_layers=1)


@pytest.mark.parametrize("raw,expected", [
    ({"model_type": "qwen3"}, None),  # no DMTD fields: loaded as it is
    ({"model_type": "qwen3", "mtp_horizon": 3}, "qwen3"),  # ours: the base type with the fields
    ({"model_type": "mtpqwen3", "mtp_horizon": 3}, "qwen3"),  # the authors'
    ({"model_type": "mtp_llama", "mtp_horizon": 3}, "llama"),
])
def test_base_model_type(raw, expected):
    assert base_model_type(raw) == expected


@pytest.mark.parametrize("prompt,generated,expected", [
    (4, 6, 6 + 4 * 2),  # roots at 4..8 with tau 3: one start (6)
    (3, 4, 6 + 2 * 2),  # roots 3, 4, 5: start 3
    (5, 1, 0),  # the prefill's token only: no decode pass
    (2, 8, 2 * 6 + 5 * 2),  # roots 2..8: starts 3, 6
])
def test_layers_run_table(prompt, generated, expected):
    assert DmtdConfig(0, 4, 2, 3).layers_run(prompt, generated) == expected


@pytest.mark.parametrize("lens,rows,positions", [
    ([7, 5, 10], [0, 2], [[4, 5, 6], [7, 8, 9]]),  # roots at 6, 4, 9
    ([5, 4, 4], [1, 2], [[1, 2, 3]]),  # one range of rows, one length: host-known positions
    ([2], [], None),
])
def test_cycle_starts_table(lens, rows, positions):
    hist = torch.arange(12)[None].repeat(len(lens), 1) * 10
    got = CycleStarts.of(lens, hist, torch.tensor(lens), 3)
    if not rows:
        assert got is None
        return
    assert got.rows == rows and got.position_ids.tolist() == positions
    assert got.tokens.tolist() == [[p * 10 for p in positions[min(i, len(positions) - 1)]] for i in range(len(rows))]
    assert got.view_len == max(lens[r] for r in rows)


# ---- the direct mode against the training forward --------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 4])
def test_direct_mode_reproduces_the_cyclic_forward(root, arch, batch):
    split = (0, 2, 2, 3)
    lm = load_model(ModelConfig(name_or_path=saved_model(arch, root, split)))
    dcfg = resolve(lm.model.config)
    assert dcfg == DmtdConfig(*split)
    outs = check_consistent(lm, dcfg, EngineConfig(method="dmtd", max_batch_size=batch))
    # the cycles change the output: DMTD is another model than the base one (not lossless)
    plain = run(lm, EngineConfig(method="ar", max_batch_size=batch), GenerationParams(max_new_tokens=40, ignore_eos=True), MORE)
    assert [o.token_ids for o in outs] != [o.token_ids for o in plain]


@pytest.mark.parametrize("split,batch", [((1, 1, 2, 2), 4), ((2, 1, 1, 4), 1), ((0, 3, 1, 1), 4), ((1, 2, 1, 3), 3)])
def test_encoding_layers_and_other_cycles(root, split, batch):
    """E > 0 (the refill recomputes the encoding layers' keys), tau 1 (every token a full pass), tau 4."""
    lm = load_model(ModelConfig(name_or_path=saved_model("qwen3", root, split)))
    check_consistent(lm, DmtdConfig(*split), EngineConfig(method="dmtd", max_batch_size=batch))


@pytest.mark.parametrize("attn,direct", [("eager", True), ("sdpa", False)])
def test_eager_attention_and_the_model_modules(root, attn, direct):
    """The same tokens through eager attention and through the model's own layer modules (no direct loop)."""
    split = (0, 2, 2, 3)
    path = saved_model("llama", root, split)
    lm = load_model(ModelConfig(name_or_path=path, attn_implementation=attn, direct_forward=direct))
    outs = check_consistent(lm, DmtdConfig(*split), EngineConfig(method="dmtd", max_batch_size=4))
    ref = run(load_model(ModelConfig(name_or_path=path)), EngineConfig(method="dmtd", max_batch_size=4),
              GenerationParams(max_new_tokens=40, ignore_eos=True), MORE)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_sliding_window_model(root):
    """A Mistral with a 6-token window: the refill blocks' bias applies the window as the cyclic forward does."""
    split = (0, 2, 2, 3)
    path = saved_model("mistral", root, split)
    raw = json.loads(open(f"{path}/config.json").read())
    raw["sliding_window"] = 6
    open(f"{path}/config.json", "w").write(json.dumps(raw))
    lm = load_model(ModelConfig(name_or_path=path))
    assert sliding_window(lm.model.config) == 6
    check_consistent(lm, DmtdConfig(*split), EngineConfig(method="dmtd", max_batch_size=4))


def test_authors_checkpoint_format_loads_and_decodes(root):
    """A config.json as the authors' Qwen3-4B DMTD checkpoint has it (model_type mtpqwen3, their architecture and
    auto_map, remote code we do not run): loaded as Qwen3 with its split, and decoded in cycles."""
    split = (0, 2, 2, 3)
    lm = load_model(ModelConfig(name_or_path=saved_model("qwen3", root, split, authors=True)))
    assert type(lm.model).__name__ == "Qwen3ForCausalLM"
    assert resolve(lm.model.config) == DmtdConfig(*split)
    check_consistent(lm, DmtdConfig(*split), EngineConfig(method="dmtd", max_batch_size=2))


def test_stops_and_lengths_are_exact(root):
    """max_new_tokens per request and a stop id end rows at the same token the plain bookkeeping would."""
    split = (0, 2, 2, 3)
    lm = load_model(ModelConfig(name_or_path=saved_model("llama", root, split)))
    free = run(lm, EngineConfig(method="dmtd", max_batch_size=4), GenerationParams(max_new_tokens=30), MORE)
    stop = free[0].token_ids[10]
    outs = run(lm, EngineConfig(method="dmtd", max_batch_size=4),
               GenerationParams(max_new_tokens=30, stop_token_ids=[stop]), MORE)
    for o, f in zip(outs, free):
        cut = f.token_ids.index(stop) + 1 if stop in f.token_ids else len(f.token_ids)
        assert o.token_ids == f.token_ids[:cut]
        assert o.finish_reason == ("stop" if cut < len(f.token_ids) or f.token_ids[-1] == stop else "length")
    for n in (1, 2, 5):
        got = run(lm, EngineConfig(method="dmtd", max_batch_size=3), GenerationParams(max_new_tokens=n), MORE)
        assert [o.token_ids for o in got] == [f.token_ids[:n] for f in free]


def test_a_pass_is_a_cycle_and_sampling_is_per_request(root):
    """One decode pass commits a cycle of tau tokens per row (one host read per cycle); seeded sampling draws each
    token from its request's own stream, so a request's tokens do not depend on the batch it runs in."""
    from esp_worker import Engine, Request
    from esp_worker.model.decoder import weight_major_linear

    split = (0, 2, 2, 3)
    lm = load_model(ModelConfig(name_or_path=saved_model("llama", root, split)))
    eng = Engine(lm, EngineConfig(method="dmtd", max_batch_size=1))
    outs = eng.generate([Request(id="0", prompt=MORE[0], params=GenerationParams(max_new_tokens=40, ignore_eos=True))])
    assert len(outs[0].token_ids) == 40 and eng.stats.decode_passes == 13  # the prefill's token, then 13 cycles of 3
    assert eng.cycle.refill_layers.linear is weight_major_linear  # the refill's 3-row products (this CPU)
    params = [GenerationParams(max_new_tokens=25, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(MORE))]
    got = {}
    for batch in (1, 4):
        eng = Engine(lm, EngineConfig(method="dmtd", max_batch_size=batch))
        got[batch] = [o.token_ids for o in eng.generate([Request(id=str(i), prompt=p, params=params[i])
                                                         for i, p in enumerate(MORE)])]
    assert got[1] == got[4] and len({tuple(t) for t in got[1]}) > 1


def test_untrained_split_and_errors():
    """A model without DMTD fields decodes in cycles with engine.dmtd_decoding_layers (speed measurements), and
    refuses engine.method=dmtd without it in one line."""
    from esp_worker import Engine

    lm = tiny("llama")
    dcfg = DmtdConfig.split(2, 2, 1)
    check_consistent(lm, dcfg, EngineConfig(method="dmtd", dmtd_tau=2, dmtd_decoding_layers=1, max_batch_size=4),
                     max_new=24)
    with pytest.raises(DmtdConfigError, match="needs a DMTD model"):
        Engine(lm, EngineConfig(method="dmtd"))
    assert not EngineConfig(method="dmtd").lossless and EngineConfig(method="dmtd_verified", dmtd_path="x").lossless
    with pytest.raises(ValueError, match="dmtd_path"):
        EngineConfig(method="dmtd_verified").validate()
    assert reference("llama", "sdpa")  # the engine helpers' reference still loads beside a DMTD engine


def test_direct_mode_log_probabilities_are_the_cyclic_forwards(root):
    """GenerationParams.logprobs (and prompt_logprobs) in the direct mode: each token's log-probability under the DMTD
    model that chose it (the cyclic forward's logits at its position), not the base model's."""
    split = (0, 2, 2, 3)
    lm = load_model(ModelConfig(name_or_path=saved_model("llama", root, split)))
    outs = run(lm, EngineConfig(method="dmtd", max_batch_size=4),
               GenerationParams(max_new_tokens=20, ignore_eos=True, logprobs=True, prompt_logprobs=True), MORE)
    for o, p in zip(outs, MORE):
        ids = lm.tokenizer(p)["input_ids"]
        seq = torch.tensor([ids + o.token_ids])
        with torch.no_grad():
            h = cyclic_forward(lm.model.get_decoder(), DmtdConfig(*split), seq, window=sliding_window(lm.model.config))
            logp = lm.model.get_output_embeddings()(h)[0].float().log_softmax(-1)
        want = logp[len(ids) - 1: -1].gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert len(o.logprobs) == 20
        assert torch.allclose(torch.tensor(o.logprobs), want, atol=1e-4)
        prompt = logp[: len(ids) - 1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        assert o.prompt_logprobs[0] is None and torch.allclose(torch.tensor(o.prompt_logprobs[1:]), prompt, atol=1e-4)
