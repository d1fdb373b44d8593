"""The generation loop: prefill -> (propose -> forward -> verify -> keep -> observe)* over a batch of rows.

Each row has its own cache length, mask vector / drafter state, sampling stream and stop state. Finished
rows leave the batch and waiting requests take their slots (continuous batching up to max_batch_size).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from . import kv_cache
from .config import EngineConfig, ModelConfig
from .feed import RequestFeed
from .drafters import Block, Drafter, PassResult, RowsView, make_drafter
from .cost_model import CostCurve
from .model_io import LoadedModel, ModelRunner, load_model
from .policy import BlockPolicy, calibrate
from .sampling import UniformStreams, choose_tokens
from .tree import mask_indices
from .types import GenerationParams, Request, RequestOutput, RequestStats
from .verify import verify, verify_greedy

REASONS = (None, "stop", "length", "context")


@dataclass
class _Seq:
    req: Request
    prompt_ids: list[int]
    seed: int
    stats: RequestStats
    t0: float = 0.0
    finish: Optional[str] = None


@dataclass
class _Rows:
    """Row-indexed batch state; every tensor is [B, ...] and moves with `select` / `extend`."""

    seqs: list[_Seq]
    t: dict[str, torch.Tensor]  # hist, hist_len, prompt_len, max_total, temperature, top_p, top_k, stop_ids
    state: dict[str, torch.Tensor]  # drafter state
    uniforms: UniformStreams
    cache: object = None
    reason: Optional[torch.Tensor] = None  # [B] finish reason code (0 = running)

    def __len__(self) -> int:
        return len(self.seqs)

    def view(self) -> RowsView:
        t = self.t
        return RowsView(t["hist"], t["hist_len"], t["prompt_len"], [s.seed for s in self.seqs], self.state)

    def select(self, rows: torch.Tensor) -> None:
        idx = rows.tolist()
        self.seqs = [self.seqs[i] for i in idx]
        self.t = {k: v.index_select(0, rows) for k, v in self.t.items()}
        self.state = {k: v.index_select(0, rows) for k, v in self.state.items()}
        self.uniforms.select(rows)
        kv_cache.select_rows(self.cache, rows)
        self.reason = self.reason.index_select(0, rows)

    def extend(self, other: "_Rows") -> None:
        if not self.seqs:
            self.seqs, self.t, self.state, self.cache, self.reason = other.seqs, other.t, other.state, other.cache, other.reason
            self.uniforms = other.uniforms
            return
        self.seqs = self.seqs + other.seqs
        self.t = {k: _cat_rows(v, other.t[k], -1 if k == "stop_ids" else 0) for k, v in self.t.items()}
        self.state = {k: _cat_rows(v, other.state[k], 0) for k, v in self.state.items()}
        self.uniforms.append_from(other.uniforms)
        self.cache = kv_cache.append_rows(self.cache, other.cache)
        self.reason = torch.cat([self.reason, other.reason])

    def ensure_capacity(self, extra: int) -> None:
        hist = self.t["hist"]
        need = int(self.t["hist_len"].max()) + extra
        if need > hist.shape[1]:
            cap = max(need, 2 * hist.shape[1])
            self.t["hist"] = torch.nn.functional.pad(hist, (0, cap - hist.shape[1]))


def _feed_taker(requests: Union[Iterable[Request], RequestFeed]) -> Callable[[int, bool], tuple[list[Request], bool]]:
    """take(n, wait) -> (up to n requests, no more will come) over an iterable or a RequestFeed."""
    if isinstance(requests, RequestFeed):
        return requests.take
    it = iter(requests)

    def take(n: int, wait: bool) -> tuple[list[Request], bool]:
        taken = list(itertools.islice(it, max(n, 0)))
        return taken, len(taken) < n

    return take


def _cat_rows(a: torch.Tensor, b: torch.Tensor, fill: int) -> torch.Tensor:
    if a.ndim >= 2 and a.shape[1:] != b.shape[1:]:
        # pad dim 1 (history capacity, stop-id lists) to the larger size
        width = max(a.shape[1], b.shape[1])
        a = torch.nn.functional.pad(a, (0, 0) * (a.ndim - 2) + (0, width - a.shape[1]), value=fill)
        b = torch.nn.functional.pad(b, (0, 0) * (b.ndim - 2) + (0, width - b.shape[1]), value=fill)
    return torch.cat([a, b])


class Engine:
    """Batched lossless speculative decoding over one Hugging Face causal LM."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, cost_curve: Optional[CostCurve] = None):
        cfg.validate()
        self.cfg = cfg
        self.loaded = loaded
        self.runner = ModelRunner(loaded)
        self.auto = cfg.block_complexity == "auto"
        sized = dataclasses.replace(cfg, block_complexity=cfg.auto_max_block) if self.auto else cfg
        self.drafter: Drafter = make_drafter(sized, self.runner)
        self.policy: Optional[BlockPolicy] = None
        if self.auto and cfg.method != "ar":
            curve = cost_curve or calibrate(self.runner, cfg.max_batch_size, cfg.auto_max_block, cfg.cost_curve_path)
            self.policy = BlockPolicy(curve, self.drafter.block_tokens, self.drafter.max_nodes, cfg.auto_max_block)
        self._plain_streak = 0  # auto + esp: consecutive plain passes since the last probe
        # auto + esp: plain passes between probes; doubles each time a probe does not lead to drafting
        self._probe_interval = cfg.auto_probe_interval
        self._probing = False  # the last pass was a probe
        self.device = loaded.device
        self.eos = torch.tensor(loaded.eos_token_ids or (-1,), dtype=torch.long)
        self.vocab_size = int(self.runner.embed.weight.shape[0])
        # seconds spent in decode passes, and the part of it inside the model (forward + LM head)
        self.timing = {"decode_s": 0.0, "model_s": 0.0, "decode_passes": 0, "peak_cache_bytes": 0}
        self.batch_histogram: collections.Counter[int] = collections.Counter()  # rows in the batch -> decode passes

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> "Engine":
        engine_cfg.validate()
        return cls(load_model(model_cfg), engine_cfg)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # ---- public API --------------------------------------------------------------------------------
    def generate(self, requests: Iterable[Request]) -> list[RequestOutput]:
        """All outputs, in input order. Request ids must be unique within one call."""
        reqs = list(requests)
        if len({str(r.id) for r in reqs}) != len(reqs):
            raise ValueError("request ids must be unique within one generate() call")
        outs = {o.id: o for o in self.generate_iter(reqs)}
        return [outs[r.id] for r in reqs]

    def generate_iter(self, requests: Union[Iterable[Request], RequestFeed]) -> Iterator[RequestOutput]:
        """Yield one RequestOutput per request as it finishes (completion order, not input order).

        `requests` is an iterable (read lazily, as slots free up) or a RequestFeed that other threads
        fill while the loop runs; with a feed the loop ends when the feed is closed and drained."""
        take = _feed_taker(requests)
        rows = _Rows([], {}, {}, UniformStreams(self.device))
        exhausted = False
        while True:
            admit: list[_Seq] = []
            if not exhausted:
                reqs, exhausted = take(self.cfg.max_batch_size - len(rows), not len(rows))
                for req in reqs:
                    prepared = self._prepare(req)
                    if isinstance(prepared, RequestOutput):
                        yield prepared
                    else:
                        admit.append(prepared)
            for chunk in self._prefill_chunks(admit):
                rows.extend(self._prefill(chunk))
            yield from self._retire(rows)
            if not len(rows):
                if exhausted:
                    return
                continue
            self.batch_histogram[len(rows)] += 1
            self._step(rows)
            yield from self._retire(rows)

    # ---- admission ---------------------------------------------------------------------------------
    def _error(self, req_id: str, msg: str) -> RequestOutput:
        return RequestOutput(id=req_id, token_ids=[], text="", finish_reason=None, stats=RequestStats(), error=msg)

    def _prepare(self, req: Request) -> Union[_Seq, RequestOutput]:
        rid = str(req.id)
        params = req.params if req.params is not None else GenerationParams()
        if not isinstance(params, GenerationParams):
            return self._error(rid, f"params must be GenerationParams, got {type(params).__name__}")
        problem = params.problem()
        if problem:
            return self._error(rid, f"invalid generation parameter: {problem}")
        ids = req.prompt_ids
        if ids is None:
            if req.prompt is None:
                return self._error(rid, "no prompt: give a prompt string or prompt token ids")
            if not isinstance(req.prompt, str):
                return self._error(rid, f"prompt must be a string, got {type(req.prompt).__name__}")
            if req.prompt == "":
                return self._error(rid, "empty prompt")
            try:
                ids = list(self.tokenizer(req.prompt)["input_ids"])
            except Exception as exc:  # e.g. lone UTF-16 surrogates the tokenizer cannot encode
                return self._error(rid, f"prompt cannot be tokenized: {type(exc).__name__}: {str(exc)[:160]}")
        if len(ids) == 0:
            return self._error(rid, "empty prompt")
        if any((not isinstance(i, int)) or i < 0 or i >= self.vocab_size for i in ids):
            return self._error(rid, f"prompt token ids must be integers in [0, {self.vocab_size})")
        ctx = self.loaded.max_context
        if len(ids) >= ctx:
            return self._error(
                rid, f"prompt has {len(ids)} tokens but the model's context is {ctx}; shorten or truncate it"
            )
        seed = params.seed if params.seed is not None else zlib.crc32(f"{self.cfg.seed}:{rid}".encode())
        stats = RequestStats(num_prompt_tokens=len(ids))
        return _Seq(req=Request(rid, req.prompt, ids, params), prompt_ids=ids, seed=seed, stats=stats)

    def _prefill_chunks(self, seqs: list[_Seq]) -> Iterator[list[_Seq]]:
        chunk: list[_Seq] = []
        longest = 0
        for s in seqs:
            n = len(s.prompt_ids)
            if chunk and max(longest, n) * (len(chunk) + 1) > self.cfg.prefill_batch_tokens:
                yield chunk
                chunk, longest = [], 0
            chunk.append(s)
            longest = max(longest, n)
        if chunk:
            yield chunk

    def _new_rows(self, seqs: list[_Seq]) -> _Rows:
        dev = self.device
        lens = [len(s.prompt_ids) for s in seqs]
        cap = max(lens) + 64
        hist = torch.zeros((len(seqs), cap), dtype=torch.long)
        for i, s in enumerate(seqs):
            hist[i, : lens[i]] = torch.tensor(s.prompt_ids)
        p = [s.req.params for s in seqs]
        extra = [list(x.stop_token_ids) + ([] if x.ignore_eos else self.eos.tolist()) for x in p]
        width = max(1, max(len(e) for e in extra))
        stop_ids = torch.full((len(seqs), width), -1, dtype=torch.long)
        for i, e in enumerate(extra):
            stop_ids[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        plen = torch.tensor(lens)
        t = {
            "hist": hist.to(dev),
            "hist_len": plen.to(dev),
            "prompt_len": plen.to(dev),
            "max_total": (plen + torch.tensor([x.max_new_tokens for x in p])).to(dev),
            "temperature": torch.tensor([float(x.temperature) for x in p], device=dev),
            "top_p": torch.tensor([float(x.top_p) for x in p], device=dev),
            "top_k": torch.tensor([int(x.top_k) for x in p], device=dev),
            "stop_ids": stop_ids.to(dev),
        }
        uni = UniformStreams(dev)
        uni.append([UniformStreams.generator(s.seed) if x.temperature > 0 else None for s, x in zip(seqs, p)])
        return _Rows(seqs, t, {}, uni, kv_cache.new_cache(), torch.zeros(len(seqs), dtype=torch.long, device=dev))

    # ---- prefill -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _prefill(self, seqs: list[_Seq]) -> _Rows:
        now = time.perf_counter()
        for s in seqs:
            s.t0 = now
        rows = self._new_rows(seqs)
        dev = self.device
        view = rows.view()
        aux = self.drafter.start_rows(view)  # [R, A, D] masks owned by the last prompt token, or None
        lens = rows.t["prompt_len"]
        r, lmax = len(seqs), int(lens.max())
        a = 0 if aux is None else aux.shape[1]
        embeds = self.runner.embed_ids(rows.t["hist"][:, :lmax])
        if a:
            embeds = torch.cat([embeds, aux.to(embeds.dtype)], 1)
        q = lmax + a
        i = torch.arange(q, device=dev)
        key_ok = (i[None] < lens[:, None]) | (i[None] >= lmax)  # [R, Q] prompt keys that exist, and masks
        causal = i[:, None] >= i[None, :]  # [Q, Q]
        visible = causal[None] & key_ok[:, None, :]
        visible |= torch.eye(q, dtype=torch.bool, device=dev)[None]  # padding rows see themselves
        pos = i[None].expand(r, q).clone()
        if a:
            pos[:, lmax:] = lens[:, None] - 1 + torch.arange(1, a + 1, device=dev)
        pos = pos.clamp(max=self.loaded.max_context - 1)
        visible = self._in_window(visible, pos, pos)
        hidden = self.runner.forward(embeds, visible, pos, rows.cache)  # [R, Q, D]
        kv_cache.truncate(rows.cache, lmax)
        last = hidden[torch.arange(r, device=dev), lens - 1]  # [R, D]
        logits = self.runner.logits(last)  # [R, V]
        rows.uniforms.ensure(1)
        tok = self._chooser(rows)(logits, torch.ones(r, dtype=torch.bool, device=dev))
        committed = tok[:, None]
        n = torch.ones(r, dtype=torch.long, device=dev)
        n_fin, reason = self._apply_stops(rows, committed, n)
        self._commit(rows, committed, n_fin, reason)
        aux_hidden = hidden[:, lmax:] if a else None
        mask_hidden = aux_hidden[:, : self.drafter.num_masks] if a and self.drafter.num_masks else None
        self.drafter.observe(rows.view(), PassResult(committed, n_fin, aux_hidden, mask_hidden, prefill=True))
        for s in seqs:
            s.stats.num_generated_tokens = 1
        return rows

    # ---- one decode pass ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _step(self, rows: _Rows) -> None:
        t_start = time.perf_counter()
        dev = self.device
        b = len(rows)
        view = rows.view()
        mass, n_nodes = None, None
        if self.policy is not None:
            n_nodes, mass = self._choose_size(view)
        block: Block = self.drafter.propose(view, n_nodes)
        tree, lay = block.tree, block.layout
        t_slots = tree.num_slots
        embeds = self.runner.embed_ids(tree.tokens)  # [B, T, D]
        if block.aux_embeds is not None:
            embeds = torch.cat([embeds, block.aux_embeds.to(embeds.dtype)], 1)
        q = embeds.shape[1]
        s_old = kv_cache.seq_len(rows.cache)
        cache_len = rows.t["hist_len"] - 1  # [B] the root is not cached
        pos = (cache_len[:, None] + lay.rel_pos).clamp(max=self.loaded.max_context - 1)  # [B, Q]
        slots = torch.arange(s_old, device=dev)
        prefix = (slots[None] < cache_len[:, None])[:, None, :].expand(b, q, s_old)
        prefix = self._in_window(prefix, pos, slots[None].expand(b, -1))  # cache slot s holds position s
        visible = torch.cat([prefix, lay.visible.expand(b, q, q)], -1)  # [B, Q, S + Q]
        model_s0 = self.runner.model_s
        hidden = self.runner.forward(embeds, visible, pos, rows.cache)
        slot_logits = self.runner.logits(hidden[:, :t_slots])  # [B, T, V]
        self.timing["peak_cache_bytes"] = max(self.timing["peak_cache_bytes"], kv_cache.nbytes(rows.cache))
        if bool((rows.t["temperature"] > 0).any()):
            rows.uniforms.ensure(block.max_depth + 1)
            res = verify(tree, slot_logits, block.max_depth, self._chooser(rows))
        else:
            res = verify_greedy(tree, slot_logits, lay.visible[:, :t_slots, :t_slots], lay.depth, block.max_depth)
        n_raw = res.num_committed
        n_fin, reason = self._apply_stops(rows, res.committed, n_raw)
        # cache: root + accepted nodes (block slots S_old + path) move right behind each row's prefix
        steps = torch.arange(res.path_slots.shape[1], device=dev)[None]
        dst = cache_len[:, None] + steps  # [B, P]
        src = torch.where(steps < n_raw[:, None], s_old + res.path_slots, dst)
        kv_cache.keep(rows.cache, dst, src, int((cache_len + n_raw).max()))
        self._commit(rows, res.committed, n_fin, reason)
        k = self.drafter.num_masks
        mask_hidden = None
        if k and block.aux_embeds is not None:
            idx = mask_indices(res.last_slot, t_slots, k)  # [B, k]
            mask_hidden = hidden.gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        self.drafter.observe(
            rows.view(),
            PassResult(res.committed, n_fin, hidden, mask_hidden, slot_logits, res.path_slots, res.last_slot, block),
        )
        # statistics
        acc = torch.minimum(n_raw - 1, n_fin)
        if mass is not None and n_nodes > 0:
            self.policy.observe(float(mass[:, :n_nodes].sum()), float((n_raw - 1).sum()))
        drafted = (tree.valid[:, 1:]).sum(-1)
        for s, nf, ac, dr in zip(rows.seqs, n_fin.tolist(), acc.tolist(), drafted.tolist()):
            st = s.stats
            st.num_decode_passes += 1
            st.num_decode_tokens += nf
            st.num_generated_tokens += nf
            st.num_drafted_tokens += dr
            st.num_accepted_drafts += ac
            if ac > len(st.accepted_per_depth):
                st.accepted_per_depth.extend([0] * (ac - len(st.accepted_per_depth)))
            for d in range(ac):
                st.accepted_per_depth[d] += 1
            if nf >= len(st.committed_histogram):
                st.committed_histogram.extend([0] * (nf + 1 - len(st.committed_histogram)))
            st.committed_histogram[nf] += 1
            st.block_size_histogram[q] = st.block_size_histogram.get(q, 0) + 1
        self._sync()
        self.timing["decode_s"] += time.perf_counter() - t_start
        self.timing["model_s"] += self.runner.model_s - model_s0  # includes the drafter's LM-head calls
        self.timing["decode_passes"] += 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- helpers -----------------------------------------------------------------------------------
    def _in_window(self, visible: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """visible [B, Q, K] restricted to keys within the model's sliding window (q_pos [B, Q], k_pos [B, K])."""
        w = self.runner.sliding_window
        if w is None:
            return visible
        return visible & ((q_pos[:, :, None] - k_pos[:, None, :]) < w)

    def _choose_size(self, view: RowsView):
        """(draft nodes for this pass, [B, max_nodes] node probabilities or None) under block_complexity=auto."""
        if self.drafter.num_masks and not bool(view.state["has_probe"].any()):
            # every row's probe is stale after plain passes; re-probe (root + masks) now and then, less often
            # while probes keep showing that drafting does not pay
            self._plain_streak += 1
            if self._plain_streak > self._probe_interval:
                self._plain_streak = 0
                self._probing = True
                return 0, None
            return -1, None
        mass = self.drafter.draft_mass(view)
        cache_len = int(view.hist_len.float().mean()) - 1
        n = self.policy.choose(mass, len(view.seeds), cache_len)
        if self._probing:
            self._probing = False
            base = self.cfg.auto_probe_interval
            self._probe_interval = base if n > 0 else min(2 * self._probe_interval, 64 * base)
        return n, mass

    def _chooser(self, rows: _Rows):
        t = rows.t
        sampling = bool((t["temperature"] > 0).any())

        def choose(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
            u = rows.uniforms.take(active) if sampling else None
            return choose_tokens(logits, t["temperature"], t["top_p"], t["top_k"], u)

        return choose

    def _apply_stops(self, rows: _Rows, committed: torch.Tensor, n: torch.Tensor):
        """Truncate each row's committed tokens at its first stop id / max_new_tokens / context limit.

        Returns (n_final [B], reason [B]: 0 running, 1 stop, 2 length, 3 context).
        """
        t = rows.t
        s = committed.shape[1]
        i = torch.arange(s, device=committed.device)[None]
        is_stop = (committed[..., None] == t["stop_ids"][:, None, :]).any(-1) & (i < n[:, None])  # [B, S]
        big = torch.full_like(n, 1 << 30)
        n_stop = torch.where(is_stop.any(-1), is_stop.long().argmax(-1) + 1, big)
        n_len = t["max_total"] - t["hist_len"]
        n_ctx = self.loaded.max_context - t["hist_len"]
        n_fin = torch.minimum(torch.minimum(n, n_stop), torch.minimum(n_len, n_ctx))
        reason = torch.zeros_like(n)
        reason = torch.where(n_fin == n_ctx, 3, reason)
        reason = torch.where(n_fin == n_len, 2, reason)
        reason = torch.where(n_fin == n_stop, 1, reason)
        n_fin, reason = self._stop_strings(rows, committed, n_fin, reason)
        return n_fin, reason

    def _stop_strings(self, rows: _Rows, committed, n_fin, reason):
        if not any(s.req.params.stop_strings for s in rows.seqs):
            return n_fin, reason
        t = rows.t
        n_list = n_fin.tolist()
        for r, s in enumerate(rows.seqs):
            stops = s.req.params.stop_strings
            if not stops or n_list[r] <= 0:
                continue
            h0, p0 = int(t["hist_len"][r]), int(t["prompt_len"][r])
            # generated so far (root included) and the new tokens
            gen = t["hist"][r, p0:h0].tolist()
            new = committed[r, : n_list[r]].tolist()
            window = max(len(x) for x in stops) + 16
            base = gen[-window:]
            before = self.tokenizer.decode(base, skip_special_tokens=True)
            for j in range(1, len(new) + 1):
                text = self.tokenizer.decode(base + new[:j], skip_special_tokens=True)
                tail = text[max(0, len(before) - max(len(x) for x in stops)) :]
                if any(x in tail for x in stops):
                    n_fin[r] = j
                    reason[r] = 1
                    break
        return n_fin, reason

    def _commit(self, rows: _Rows, committed: torch.Tensor, n_fin: torch.Tensor, reason: torch.Tensor) -> None:
        t = rows.t
        s = committed.shape[1]
        rows.ensure_capacity(s)
        hist = t["hist"]
        i = torch.arange(s, device=committed.device)[None]
        idx = (t["hist_len"][:, None] + i).clamp(max=hist.shape[1] - 1)
        cur = hist.gather(1, idx)
        hist.scatter_(1, idx, torch.where(i < n_fin[:, None], committed, cur))
        t["hist_len"] = t["hist_len"] + n_fin
        rows.reason = torch.where(rows.reason == 0, reason, rows.reason)

    def _retire(self, rows: _Rows) -> Iterator[RequestOutput]:
        if not len(rows):
            return
        done = rows.reason != 0
        if not bool(done.any()):
            return
        t = rows.t
        now = time.perf_counter()
        for r in done.nonzero().flatten().tolist():
            s = rows.seqs[r]
            p0, h = int(t["prompt_len"][r]), int(t["hist_len"][r])
            ids = t["hist"][r, p0:h].tolist()
            s.stats.num_generated_tokens = len(ids)
            s.stats.time_s = now - s.t0
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            yield RequestOutput(
                id=s.req.id, token_ids=ids, text=text, finish_reason=REASONS[int(rows.reason[r])], stats=s.stats
            )
        rows.select((~done).nonzero().flatten())
