"""One forward over a block of input embeddings: the only code that calls the Hugging Face model's layers."""
from __future__ import annotations

import collections
import contextlib
import inspect
import time
from typing import Any, Callable, Optional

import torch

from ..grad import inference
from ..tree import gather_slots
from .decoder import direct_decoder
from .layers import ModuleLayers
from .errors import ModelLoadError
from .load import LoadedModel, sliding_window


class ModelRunner:
    """One forward over a block of input embeddings with an explicit 4D mask and position ids.

    The HF base model produces hidden states; logits are computed only where the caller asks
    (`logits_at`), so a 60-token block does not materialise 60 x vocab logits it never reads.
    """

    def __init__(self, loaded: LoadedModel, compile: bool = False, compile_mode: str = "",
                 attention_backend: str = "torch"):
        self.loaded = loaded
        self.model = loaded.model
        self.base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        # the decoder's name for the KV cache argument: `cache` from transformers 5.24 (`past_key_values`, before,
        # is deprecated there and goes in 5.40)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(self.base.forward).parameters else "past_key_values"
        # the layer loop called directly where the architecture allows (bitwise equal hidden states)
        self.direct = direct_decoder(self.base) if loaded.direct_forward else None
        if self.direct is not None:
            self.direct.use_attention(attention_backend)
        if compile:
            if self.direct is None:
                raise ModelLoadError(
                    "engine.compile needs the direct forward (model.direct_forward=true and a Llama, Mistral, Qwen2 or "
                    "Qwen3 model with sdpa or eager attention); set engine.compile=false"
                )
            self.direct.compile(compile_mode or None)
        self.lm_head = self.model.get_output_embeddings()
        # a forward with bias None and Q > 1 is causal (SDPA's is_causal); the other paths need the mask
        self.causal_without_bias = self.direct is not None and self.direct.sdpa
        self.embed = self.model.get_input_embeddings()
        # a plain embedding and LM head (the direct forward checked the model has no hooks) run as the functional
        # op itself, without nn.Module's call machinery (two calls per pass)
        plain = self.direct is not None
        self._embed_fn = _plain_embedding(self.embed) if plain else None
        self._head_fn = _plain_linear(self.lm_head) if plain else None
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        self.logit_scale = getattr(self.model.config, "logit_scale", None)
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.mask_min = torch.finfo(loaded.dtype).min
        self.sliding_window = sliding_window(self.model.config)  # None = full attention
        # a prefill (fresh tokens, no cached part) takes a mask tensor: not where bias None is causal and the whole
        # context is visible
        self.prefill_needs_mask = not self.causal_without_bias or self.sliding_window is not None
        # seconds inside forward() and logits() (and a replayed pass): model compute, for host-overhead accounting
        self._clock = ModelClock(self.device)
        # the layers as groups (DMTD runs some layers for some tokens): the direct loop, else the model's modules
        self.layers: Any = self.direct if self.direct is not None else ModuleLayers(self.base)
        # a drafter that reads the model's hidden states entering one layer (dmtd_verified: its trunk's output) sets
        # the layer here; every forward then leaves them in `tapped` [B, Q, D] (every input, `keep` or not)
        self.tap_layer: Optional[int] = None
        self.tapped: Optional[torch.Tensor] = None

    # name the model's calls in a torch.profiler trace (jobs/bench/profiling.py turns it on; off, no cost per call)
    profile_marks = False

    def _mark(self, name: str):
        return torch.profiler.record_function(name) if self.profile_marks else contextlib.nullcontext()

    @property
    def model_s(self) -> float:
        """Seconds inside the model's calls so far (on CUDA: of the calls the device has finished, which after a
        pass's one host read are all of that pass's)."""
        return self._clock.seconds()

    @property
    def clock(self) -> "ModelClock":
        """The model's clock (its marks time the calls of one pass run ahead of its read)."""
        return self._clock

    @inference
    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [..., ] -> [..., D]
        return self._embed_fn(ids) if self._embed_fn is not None else self.embed(ids)

    @inference
    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [B, Q, D]
        bias: Optional[torch.Tensor],  # [B, 1, Q, S] additive attention bias (inputs.attention_bias); None = all visible
        position_ids: torch.Tensor,  # [B, Q]
        cache: Any,  # kv_cache.KVCache, planned for this forward (rows, write slots, S)
        max_position: Optional[int] = None,  # a bound on position_ids known on the host (lets RoPE use a table)
        keep: Optional[torch.Tensor] = None,  # [B, K] positions whose hidden states are wanted (None = all)
    ) -> torch.Tensor:
        """Hidden states [B, Q, D] (or [B, K, D] at `keep`); the cache holds the block's keys and values where it
        was planned."""
        assert inputs_embeds.ndim == 3 and (bias is None or bias.ndim == 4) and position_ids.ndim == 2
        mark = self._clock.start()
        with self._mark("model.forward"):
            hidden = self._forward(inputs_embeds, bias, position_ids, cache, max_position, keep)
        self._clock.stop(mark)
        return hidden

    def _forward(self, inputs_embeds, bias, position_ids, cache, max_position, keep) -> torch.Tensor:
        if self.tap_layer is not None:  # the layers in two groups, the hidden states between them kept
            layers, tap = self.layers, self.tap_layer
            rope = layers.rope(inputs_embeds, position_ids, max_position)
            self.tapped = layers.run(inputs_embeds, 0, tap, rope, bias, cache)
            hidden = layers.norm(layers.run(self.tapped, tap, len(self.base.layers), rope, bias, cache, keep))
            return hidden if keep is None else hidden[:, : keep.shape[1]]
        if self.direct is not None:
            hidden = self.direct(inputs_embeds, bias, position_ids, cache, max_position, keep)
        else:
            hidden = self.base(
                inputs_embeds=inputs_embeds,
                attention_mask=bias,
                position_ids=position_ids,
                use_cache=True,
                **{self._cache_kwarg: cache},
            ).last_hidden_state
            if keep is not None:
                hidden = gather_slots(hidden, keep)
        return hidden

    @contextlib.contextmanager
    def timing(self, name: str = "model.forward"):
        """Count the block's time as model time (a forward run as layer groups, model/dmtd.py; a replayed pass,
        engine.cuda_graphs)."""
        mark = self._clock.start()
        with self._mark(name):
            yield
        self._clock.stop(mark)

    @inference
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., D] -> logits [..., V] in float32
        mark = self._clock.start()
        with self._mark("model.logits"):
            logits = self.head(hidden)
        self._clock.stop(mark)
        return logits

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V]: the LM head with the model's scale and soft cap, a function
        of tensors only (also inside the captured pass, `graphs/step.py`)."""
        logits = self._head_fn(hidden) if self._head_fn is not None else self.lm_head(hidden)
        if logits.dtype != torch.float32:
            logits = logits.float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class ModelClock:
    """Seconds inside the model's calls. On a CPU the wall clock around each call. On CUDA a pair of events per
    call, summed once the device has passed them: no call waits for the device, and the pass's one host read
    (which waits for everything queued before it) completes the pass's events, so its model time is known at its
    end. Events are reused (a few per pass)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.done_s = 0.0
        self._pending: collections.deque = collections.deque()  # (start, end) events not read yet, in order
        self._free: list = []  # events to record again
        self.calls = 0  # calls timed so far
        self._summed = 0  # of which in done_s
        self._at: dict[int, Optional[float]] = {}  # mark -> done_s once the calls before it are summed

    def start(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        return self._record()

    def stop(self, mark: Any) -> None:
        self.calls += 1
        if not self.cuda:
            self._summed_one(time.perf_counter() - mark)
            return
        self._pending.append((mark, self._record()))

    def seconds(self) -> float:
        while self._pending and self._pending[0][1].query():  # query() asks, it does not wait
            start, end = self._pending.popleft()
            self._summed_one(start.elapsed_time(end) / 1000.0)
            self._free += [start, end]
        return self.done_s

    def mark(self) -> int:
        """A point between calls: `between(a, b)` is then the seconds of the calls from mark a to mark b, known once
        the device has passed them (a pass run ahead of its read: its own model time, at its read)."""
        self._at[self.calls] = self.done_s if self._summed == self.calls else None
        return self.calls

    def between(self, a: int, b: int) -> Optional[float]:
        """Seconds of the calls from mark a to mark b (both taken with `mark`), or None while the device has not
        passed them; the marks before b are then forgotten (b may start the next pass's calls)."""
        self.seconds()
        start, end = self._at.get(a), self._at.get(b)
        if start is None or end is None:
            return None
        for m in [m for m in self._at if m < b]:
            del self._at[m]
        return end - start

    def _summed_one(self, seconds: float) -> None:
        self.done_s += seconds
        self._summed += 1
        if self._summed in self._at:
            self._at[self._summed] = self.done_s

    def _record(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def _plain_embedding(m: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """ids -> F.embedding with m's weight, when m is exactly an nn.Embedding that computes only that."""
    if type(m) is not torch.nn.Embedding or m.max_norm is not None:
        return None
    # torch.embedding is what F.embedding calls after its argument checks (padding_idx only matters for
    # gradients; -1 = none); calling it directly saves the wrapper's Python on every call
    pad = -1 if m.padding_idx is None else m.padding_idx
    return lambda ids: torch.embedding(m.weight, ids, pad, False, False)


def _plain_linear(m: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """x -> F.linear with m's weight and bias, when m is exactly an nn.Linear."""
    if type(m) is not torch.nn.Linear:
        return None
    return lambda x: torch.nn.functional.linear(x, m.weight, m.bias)
