"""Load a causal LM + tokenizer. Sources:
- a local directory or hub id (``AutoModelForCausalLM``; ``trust_remote_code`` only when configured);
- ``tiny-random-<arch>`` for arch in llama | qwen2 | qwen3 | mistral: a small model built from a config with
  a fixed seed and a byte-level tokenizer built in memory (no download), for offline demos and tests;
- ``random:<shape>``: a real-size architecture with random weights, offline, for throughput and cost curves
  where no weights can be downloaded. <shape> is a config shipped in esp_worker/model_configs (llama-1b,
  llama-3b, llama-8b, qwen3-1.7b, qwen3-8b) or a local config.json path; the byte-level tokenizer is used.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import ATTN_IMPLS, DTYPES, RANDOM_PREFIX, TINY_PREFIX, ModelConfig
from .errors import ModelLoadError

SHIPPED_CONFIGS = Path(__file__).parent / "model_configs"
TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel (causal LM), eval mode
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    max_context: int  # positions the model can address (prompt + generated)
    name: str
    direct_forward: bool = True  # ModelConfig.direct_forward
    # what a prefill forward of this model costs on its device (engine.prefill_forward_tokens=auto on CUDA:
    # measured by the first engine over it, cost_model.PrefillCost)
    prefill_cost: Optional[Any] = None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device={device!r} but CUDA is not available here; use model.device=cpu or auto")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype={dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return _DTYPES[dtype]


def build_tiny_tokenizer() -> Any:
    """A byte-level tokenizer (256 byte tokens + bos/eos/pad) built in memory: no files, no download.

    Like Llama 3 it prepends bos: ``tok("hi").input_ids == [0, id('h'), id('i')]``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", 0)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=specials[0], eos_token=specials[1], pad_token=specials[2]
    )
    return tok


def build_tiny_config(arch: str, vocab_size: int) -> Any:
    """A small config of the given architecture (2 layers, GQA, 64 hidden): fast on CPU, real code paths."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=None, **common)
    raise ModelLoadError(f"tiny-random architecture {arch!r} is unknown; use one of {', '.join(TINY_ARCHS)}")


def build_tiny_model(arch: str, seed: int = 0) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = build_tiny_config(arch, vocab_size=len(tokenizer))
    # Larger init than the default 0.02 so a random model's greedy choices are not all ties/loops.
    config.initializer_range = 0.2
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    return model, tokenizer


def random_config_path(shape: str) -> Path:
    """`llama-1b` -> the shipped JSON; anything else must be a local config.json (or a directory holding one)."""
    shipped = SHIPPED_CONFIGS / f"{shape}.json"
    if shipped.is_file():
        return shipped
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in SHIPPED_CONFIGS.glob("*.json")))
        raise ModelLoadError(f"model.name_or_path=random:{shape}: no such config; use one of {names} or a local config.json")
    return path


def build_random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> tuple[Any, Any]:
    """A model of a real architecture and size with random weights (normal, the config's initializer_range),
    built on `device` without downloading anything, and the byte-level tokenizer (ids 0..258; the model's
    vocabulary keeps its real size, so the LM head costs what it costs in the real model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(random_config_path(shape).read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    model_type = raw.pop("model_type", None)
    if model_type is None:
        raise ModelLoadError(f"random:{shape}: the config has no model_type")
    raw.update(bos_token_id=0, eos_token_id=1, pad_token_id=2)  # the byte-level tokenizer's specials
    config = AutoConfig.for_model(model_type, **raw)
    tokenizer = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(config, key))
    return model, tokenizer


def _eos_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if src is None:
            continue
        for i in (src if isinstance(src, (list, tuple)) else [src]):
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        if int(tokenizer.eos_token_id) not in ids:
            ids.append(int(tokenizer.eos_token_id))
    return tuple(ids)


def _max_context(model: Any, tokenizer: Any) -> int:
    cfg = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        val = getattr(cfg, name, None)
        if isinstance(val, int) and val > 0:
            return val
    val = getattr(tokenizer, "model_max_length", None)
    return int(val) if isinstance(val, int) and 0 < val < 10**8 else 2048


def load_model(cfg: ModelConfig) -> LoadedModel:
    """Load model and tokenizer per `cfg`. Raises ModelLoadError with a one-line message."""
    if cfg.attn_implementation in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        raise ModelLoadError(
            f"model.attn_implementation={cfg.attn_implementation!r} cannot take the 4D tree attention mask that "
            "speculative decoding needs; use sdpa (default) or eager"
        )
    if cfg.attn_implementation not in ATTN_IMPLS:
        raise ModelLoadError(
            f"model.attn_implementation={cfg.attn_implementation!r} is unknown; use one of {', '.join(ATTN_IMPLS)}"
        )
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    name = cfg.name_or_path
    if name.startswith(TINY_PREFIX):
        arch = name[len(TINY_PREFIX):]
        if arch not in TINY_ARCHS:
            raise ModelLoadError(f"model.name_or_path={name!r}: tiny-random arch must be one of {', '.join(TINY_ARCHS)}")
        model, tokenizer = build_tiny_model(arch, seed=cfg.seed)
        model.config._attn_implementation = cfg.attn_implementation
        model = model.to(device=device, dtype=dtype)
    elif name.startswith(RANDOM_PREFIX):
        model, tokenizer = build_random_model(name[len(RANDOM_PREFIX):], dtype, device, seed=cfg.seed)
        model.config._attn_implementation = cfg.attn_implementation
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .dmtd import hf_config, read_config_json

        kw = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        raw = read_config_json(name, cfg.revision)
        dmtd = hf_config(raw) if raw is not None else None  # the authors' DMTD format (mtpqwen3): its base class
        if dmtd is not None:
            kw["config"] = dmtd
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, **{k: v for k, v in kw.items() if k != "config"})
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, attn_implementation=cfg.attn_implementation, **kw
            )
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelLoadError(
                f"cannot load model {name!r}: {first} (give a local directory with config.json and weights, "
                "or a hub id reachable from this machine; set model.trust_remote_code=true only for code you trust)"
            ) from None
        model = model.to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        eos_token_ids=_eos_ids(model, tokenizer),
        max_context=_max_context(model, tokenizer),
        name=name,
        direct_forward=cfg.direct_forward,
    )


def sliding_window(config: Any) -> Optional[int]:
    """The attention window every layer uses (None = full attention). Our 4D mask replaces the model's own
    mask, so the window is applied there. Models mixing windowed and full layers cannot share one mask."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = set(getattr(config, "layer_types", None) or [])
    if types and types != {"sliding_attention"}:
        if "sliding_attention" not in types:
            return None
        raise ModelLoadError(
            "this model mixes sliding-window and full-attention layers, which one tree mask cannot express; "
            "it is not supported yet"
        )
    return int(window)
