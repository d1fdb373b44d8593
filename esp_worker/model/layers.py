"""The model's own decoder-layer modules run as groups of layers (`ModuleLayers`), with the direct decoder's
`rope` / `run` / `norm` interface (model/decoder.py): the runner's fallback where the direct loop does not apply,
and DMTD's training forward (model/dmtd.py), which needs autograd through the modules."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch

from ..tree import gather_slots


class ModuleLayers:
    """The model's own decoder-layer modules as groups, with the direct decoder's `rope` / `run` / `norm`
    interface: where the direct loop does not apply (model.direct_forward=false, hooks), and for training
    (autograd through the modules; `cache` None)."""

    def __init__(self, base: Any, layers: Any = None):
        self.base = base
        self.modules = base.layers if layers is None else layers
        # the layers' name for the KV cache argument (`cache` from transformers 5.24, `past_key_values` before)
        params = inspect.signature(self.modules[0].forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor, max_position: Optional[int] = None) -> tuple:
        return self.base.rotary_emb(x, position_ids=position_ids)

    def run(self, h: torch.Tensor, start: int, stop: int, rope: tuple, bias: Optional[torch.Tensor], cache: Any,
            keep: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Layers start .. stop-1 on h [B, Q, D]; bias [B, 1, Q, S] additive (None: causal, SDPA only)."""
        for layer in self.modules[start:stop]:
            h = layer(h, attention_mask=bias, position_embeddings=rope, use_cache=cache is not None,
                      **{self._cache_kwarg: cache})
            h = h[0] if isinstance(h, tuple) else h  # transformers < 4.54 returned (hidden, ...)
        return h if keep is None else gather_slots(h, keep)

    def few_rows(self) -> "ModuleLayers":
        """The layers for products over a few rows (DirectDecoder.few_rows): the modules compute their own."""
        return self

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.base.norm(h)
