"""Drafters: propose draft trees behind one interface (see base.Drafter)."""
from __future__ import annotations

from ..config import EngineConfig
from ..model.runner import ModelRunner
from ..passes import Block, PassRecord, RowsView
from .base import Drafter, PlainDrafter
from .mask_probe import MaskModel, MaskSettings


def make_drafter(cfg: EngineConfig, runner: ModelRunner) -> Drafter:
    """The drafter for `cfg.method`, sized by the block complexity."""
    if cfg.method in ("ar", "dmtd"):  # dmtd: one token per pass, the model's layer groups (engine.cycle)
        return PlainDrafter()
    if cfg.method == "pld":
        from .pld import PromptLookupDrafter

        return PromptLookupDrafter(cfg.pld_max_ngram, cfg.pld_min_ngram, min(cfg.pld_depth, cfg.block_complexity - 1))
    if cfg.method == "esp":
        from .esp import ESPDrafter

        return ESPDrafter(_mask_model(runner), _mask_settings(cfg), cfg.block_complexity, tree=cfg.tree,
                          branches=list(cfg.branches), expansion=cfg.expansion)
    if cfg.method == "hybrid":
        from .corpus import CorpusNgrams
        from .hybrid import HybridDrafter, HybridSettings
        from .pld import PromptLookupDrafter
        from .stand import StandDrafter

        store = StandDrafter(max(cfg.block_complexity - 1, 1), cfg.stand_depth, cfg.stand_topk, cfg.stand_max_ngram,
                             cfg.stand_min_ngram)
        corpus = CorpusNgrams(cfg.hybrid_corpus_tokens, cfg.stand_max_ngram, cfg.stand_min_ngram, runner.device) \
            if cfg.hybrid_corpus_tokens > 0 else None
        chain = PromptLookupDrafter(cfg.stand_max_ngram, cfg.stand_min_ngram, min(cfg.stand_depth, cfg.block_complexity - 1),
                                    corpus=corpus)
        heads = _cp_heads(cfg, runner, min(HYBRID_HEADS_NODES, cfg.block_complexity - 1)) if cfg.heads_path else None
        settings = HybridSettings(cfg.block_complexity, mask_every=cfg.hybrid_mask_every,
                                  mask_min_nodes=cfg.hybrid_mask_min_nodes, expansion=cfg.expansion)
        return HybridDrafter(store, chain, _mask_model(runner), _mask_settings(cfg), settings, corpus=corpus,
                             heads=heads)
    if cfg.method == "stand":
        from .stand import StandDrafter

        return StandDrafter.from_config(cfg, runner)
    if cfg.method == "lade":
        from .lade import LookaheadDrafter

        return LookaheadDrafter.from_config(cfg, runner)
    if cfg.method == "cp_heads":
        return _cp_heads(cfg, runner, cfg.block_complexity - 1)
    if cfg.method == "dmtd_verified":
        from .dmtd_verified import DmtdVerifiedDrafter

        return DmtdVerifiedDrafter(runner, cfg.dmtd_path, cfg.dmtd_tau)
    raise ValueError(f"engine.method={cfg.method!r} is unknown")


# hybrid with heads: the heads' pool is this many nodes wide (N best depth-1 tokens, N - 1 children of the
# N - 1 best); wider pools cost [B, P2, P] merge work for nodes a shared tree rarely keeps
HYBRID_HEADS_NODES = 8


def _cp_heads(cfg: EngineConfig, runner: ModelRunner, num_nodes: int):
    """The trained heads at `engine.heads_path` as a drafter of `num_nodes` nodes (cp_heads, and inside hybrid)."""
    from ..model.heads import load_heads
    from .cp_heads import CPHeadsDrafter

    heads = load_heads(cfg.heads_path, runner.model, runner.device)
    return CPHeadsDrafter(heads, lambda z: runner.logits(z.to(runner.dtype)), num_nodes)


def _mask_model(runner: ModelRunner) -> MaskModel:
    """What ESP's probe needs of the model (esp and hybrid)."""
    return MaskModel(runner.embed_ids, runner.logits, runner.embed.weight.detach(), runner.dtype)


def _mask_settings(cfg: EngineConfig) -> MaskSettings:
    """ESP's mask settings (esp and hybrid)."""
    return MaskSettings(num_masks=cfg.num_masks, mask_init=cfg.mask_init, mask_init_last_k=cfg.mask_init_last_k,
                        mask_init_offset=cfg.mask_init_offset, ema_lambda=cfg.ema_lambda,
                        probe_prefill=cfg.probe_prefill, prune=cfg.prune)


__all__ = ["Block", "Drafter", "PassRecord", "PlainDrafter", "RowsView", "make_drafter"]
