"""The generation loop: prefill, then decode passes (plan -> propose -> forward -> settle -> observe -> end of
pass) over a batch of rows; `passes.py` has the typed values the verbs hand on.

Each row has its own cache length, mask vector / drafter state, sampling stream and stop state. Finished
rows leave the batch and waiting requests take their slots (continuous batching up to max_batch_size).
A decode pass never reads the device between propose and commit; at its end the host reads one small
tensor (every row's length and finish reason, `Rows.read_back`). Under engine.cuda_graphs_run_ahead a replayed
pass is launched before the last one's read (`_step_ahead`), so that the host's work overlaps the device's.
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import itertools
import logging
import operator
import time
from typing import Iterable, Iterator, Optional, Union

import torch

from . import kv_cache
from .admission import Admission
from .auto.cost_model import CostCurve, measure_prefill_cost
from .auto.planner import FixedPlanner, Planner
from .auto.policy import BlockPolicy, PolicySettings, calibrate
from .auto.sizer import DraftSizer
from .batch import PendingRead, Rows, RowTensors, Seq, finish_stats, new_counters, write_history
from .config import CYCLE_METHODS, EngineConfig, ModelConfig
from .consts import steps
from .drafters import Drafter, make_drafter
from .drafters.base import PlainDrafter
from .feed import RequestFeed
from .grad import inference
from .graphs.buffers import ModelDims
from .graphs.hooks import StepHooks
from .graphs.runner import MAX_GRAPHS, GraphPass, GraphRunner
from .graphs.step import StepModel, compiled_step, graph_support
from .logprobs import TokenLogprobs, chosen_logprobs, path_logprobs, prompt_logprobs
from .memory import kv_bytes_per_slot, require
from .model.attention import StaticBlockBias, attention_bias
from .model.dmtd import CycleForward, CycleStarts, resolve as resolve_dmtd
from .model.errors import ModelLoadError
from .model.load import LoadedModel, load_model
from .model.runner import ModelClock, ModelRunner
from .passes import Block, ForwardOut, PassRecord, Placement, RowsView, Settled
from .prefill_plan import CPU_FORWARD_TOKENS, plan_chunks
from .prefix_cache import PrefixReuse
from .sampling import UniformStreams, choose_tokens
from .stats import EngineStats, PassClock, now
from .stops import REASONS, apply_stop_strings, apply_stops, row_limits, stop_table
from .tree import gather_slots, mask_indices
from .types import GenerationParams, Request, RequestOutput, RequestStats, default_seed
from .verify import VerifyResult, verify, verify_greedy

log = logging.getLogger(__name__)

# block_complexity=auto decides each pass at the end of the one before (`PolicySettings.prepare_looks`) on an
# accelerator, where a host read drains the device's queue; on a CPU a read costs nothing and deciding with the
# latest statistics measured faster. None = by device (tests set True to check the accelerator's way on a CPU)
PREPARE_LOOKS: Optional[bool] = None
# engine.cuda_graphs captures graphs on CUDA and runs the static path eagerly elsewhere. None = by device (tests
# set True, with a stand-in for `graphs.runner.capture_graph`, to drive the capture path on a CPU)
CAPTURE_GRAPHS: Optional[bool] = None


class _Requests:
    """The requests to come: a RequestFeed, a sequence (a list), or any other iterable, read lazily as slots free
    up (never ahead: it may be a stream)."""

    def __init__(self, requests: Union[Iterable[Request], RequestFeed]):
        self._feed = requests if isinstance(requests, RequestFeed) else None
        self._seq = requests if isinstance(requests, collections.abc.Sequence) else None
        self._it = iter(requests) if self._feed is None and self._seq is None else None
        self._next = 0  # the sequence's next request

    def take(self, n: int, wait: bool) -> tuple[list[Request], bool]:
        """(up to n requests, no more will come); with a feed and `wait`, blocks until one is queued."""
        if self._feed is not None:
            return self._feed.take(n, wait)
        if self._seq is not None:
            taken = list(self._seq[self._next: self._next + max(n, 0)])
            self._next += len(taken)
            return taken, self._next >= len(self._seq)
        taken = list(itertools.islice(self._it, max(n, 0)))
        return taken, len(taken) < n

    def upcoming(self, n: int) -> list[Request]:
        """Up to n of the next requests, still to be taken (none from a plain iterable): the prefix store keeps a
        prefix an admitted prompt shares with them (the samples of one prompt, admitted one by one)."""
        if self._feed is not None:
            return self._feed.peek(n)
        return list(self._seq[self._next: self._next + n]) if self._seq is not None else []


@dataclasses.dataclass
class _InFlight:
    """A pass launched and not yet read (engine.cuda_graphs_run_ahead)."""

    read: PendingRead  # its lengths and finish reasons, on their way to the host
    lens: list[int]  # the rows' lengths before it (exact once the pass before it is read)
    size: int  # its block size (tokens fed per row)
    width: int  # the most tokens it commits to a row (1: a plain pass)
    timing: Optional["_PassTiming"] = None  # for block_complexity=auto's policy


@dataclasses.dataclass(frozen=True)
class _PassTiming:
    """What a pass run ahead of its read cost, for the policy: the host's seconds launching it (on a CPU, where the
    static path runs eagerly, its model's too; None: it compiled or captured, and says nothing of its mode's cost),
    and the model clock's marks around its calls (their seconds are known at its read). With the host building a
    pass while the device runs the one before, a pass costs the longer of the two."""

    host_s: Optional[float]
    marks: tuple[int, int]

    def read(self, clock: ModelClock) -> tuple[Optional[float], Optional[float]]:
        """At the pass's read: (its seconds, its model seconds), or (None, None) when it says nothing."""
        model_s = clock.between(*self.marks)  # forgets the marks either way
        if self.host_s is None or model_s is None:
            return None, None
        return max(self.host_s, model_s), model_s


class Engine:
    """Batched lossless speculative decoding over one Hugging Face causal LM."""

    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, cost_curve: Optional[CostCurve] = None,
                 graphs: Optional[GraphRunner] = None):
        """graphs: another engine's `graphs` to replay instead of capturing anew (same model, device, batch size and
        slots; engines that share one must run one at a time): what a process that builds several engines in
        turn over one model, as `jobs.bench` does, captures once, as one long-lived engine would."""
        cfg.validate()
        if cfg.block_complexity == "auto" and cfg.auto_max_block > loaded.max_context // 2:
            # auto's cost curve times blocks behind up to half the context of cached tokens: a larger block would
            # not fit behind them, and no row has room for it in the first place
            log.info("engine.auto_max_block=%d: %d, half the model's context", cfg.auto_max_block, loaded.max_context // 2)
            cfg = dataclasses.replace(cfg, auto_max_block=loaded.max_context // 2)
        self.cfg = cfg
        self.loaded = loaded
        self.runner = ModelRunner(loaded, cfg.compile, cfg.compile_mode, cfg.attention_backend)
        self.device = loaded.device
        self.auto = cfg.block_complexity == "auto" and cfg.method not in CYCLE_METHODS
        sized = dataclasses.replace(cfg, block_complexity=cfg.auto_max_block) if self.auto else cfg
        self.drafter: Drafter = make_drafter(sized, self.runner)
        self.eos = torch.tensor(loaded.eos_token_ids or (-1,), dtype=torch.long)
        self.vocab_size = int(self.runner.embed.weight.shape[0])
        # token ids a pass can commit: the LM head's outputs (the stop table covers them all)
        self.num_logits = max(self.vocab_size, int(getattr(self.runner.lm_head, "out_features", 0) or 0))
        self.stats = EngineStats()
        # rows admitted at once: engine.max_batch_size, until a job's actor lowers it after a batch ran out of memory
        self.max_rows = cfg.max_batch_size
        self.num_layers = loaded.model.config.get_text_config().num_hidden_layers
        self.slot_bytes = kv_bytes_per_slot(loaded.model.config.get_text_config(), self.runner.dtype)  # one position
        # engine.method=dmtd: the model's own layer groups per pass (model/dmtd.py); the drafter is plain decoding's
        self.cycle: Optional[CycleForward] = None
        if cfg.method == "dmtd":
            self.cycle = CycleForward(self.runner, resolve_dmtd(loaded.model.config, cfg.dmtd_tau, cfg.dmtd_decoding_layers))
        self.graphs: Optional[GraphRunner] = self._graphs(graphs)  # engine.cuda_graphs (captures at start-up on CUDA)
        self.policy: Optional[BlockPolicy] = self._policy(cost_curve)
        self.planner: Planner = self.policy if self.policy is not None else FixedPlanner()
        if isinstance(self.drafter, DraftSizer):
            self.drafter.mass_wanted = self.policy is not None
        self._static_bias = StaticBlockBias()  # attention bias of repeating block layouts (rows of one length)
        self.prefill_forward_tokens = self._forward_tokens()  # a prefill forward's cost in tokens (prefill_plan.py)
        self.admission = self._admission()  # when waiting requests join (continuous batching)
        # engine.prefix_cache_tokens: prompt prefixes that requests share, prefilled once (prefix_cache.py). Not where
        # a prefill reads every prompt position's states: DMTD's cycle, dmtd_verified's trunk (runner.tap_layer)
        self.prefixes: Optional[PrefixReuse] = None
        if cfg.prefix_cache_tokens and self.cycle is None and self.runner.tap_layer is None:
            self.prefixes = PrefixReuse(self.runner, self.num_layers, cfg.prefix_cache_tokens,
                                        self.prefill_forward_tokens, self.slot_bytes, self.stats, cfg.max_batch_size)
        self._in_flight: Optional[_InFlight] = None  # engine.cuda_graphs_run_ahead: the pass not yet read
        self._exhausted = False  # no request is left to join (the requests' iterable ended, or the feed closed)
        self._requests = _Requests(())  # the requests of the running generate_iter

    def _graphs(self, shared: Optional[GraphRunner]) -> Optional[GraphRunner]:
        """engine.cuda_graphs' runner over a KV slab pinned for the whole engine (graphs read it at fixed addresses),
        or None when passes run eagerly. auto = on for CUDA; true on a CPU runs the static path eagerly. `shared`:
        a runner of another engine, taken over with fresh counters when it fits this engine."""
        cfg, runner = self.cfg, self.runner
        wanted = cfg.cuda_graphs if cfg.cuda_graphs != "auto" else self.device.type == "cuda"
        if not wanted:
            return None
        why = graph_support(runner) if self.cycle is None else "engine.method=dmtd runs other layers on some passes"
        if why is not None:
            if cfg.cuda_graphs is True:
                raise ModelLoadError(f"engine.cuda_graphs=true cannot capture this model's passes: {why}; set "
                                     f"engine.cuda_graphs=auto or false")
            log.info("engine.cuda_graphs: passes run eagerly: %s", why)
            return None
        text = self.loaded.model.config.get_text_config()
        attn = runner.direct.base.layers[0].self_attn
        slots = min(cfg.cuda_graph_max_len, self.loaded.max_context)
        dims = ModelDims(int(text.hidden_size), self.num_logits, runner.dtype, self.device)
        if shared is not None:
            misfit = shared.misfit(runner.direct, dims, cfg.max_batch_size, slots, cfg.cuda_graphs_compile)
            if misfit:
                raise ValueError(f"Engine(graphs=...): that runner does not fit this engine: {misfit}")
            self.stats.graphs = shared.restart_stats()
            return shared
        require(f"engine.max_batch_size={cfg.max_batch_size}: the KV slab pinned for engine.cuda_graphs "
                f"({cfg.max_batch_size} rows of {slots} positions)",
                cfg.max_batch_size * slots * self.slot_bytes,
                "lower engine.max_batch_size or engine.cuda_graph_max_len", self.device)
        cache = kv_cache.new_cache(self.num_layers)
        cache.pin(cfg.max_batch_size, slots, text.num_key_value_heads, attn.head_dim, runner.dtype, self.device)
        cache.before_growth = self._may_grow
        capture = CAPTURE_GRAPHS if CAPTURE_GRAPHS is not None else self.device.type == "cuda"
        model = StepModel.of(runner, slots)
        compiled = compiled_step(model, cfg.compile_mode, MAX_GRAPHS) if cfg.cuda_graphs_compile else None
        graphs = GraphRunner(model, dims, cache, cfg.max_batch_size, capture, compiled)
        self.stats.graphs = graphs.stats
        graphs.capture_plain()
        return graphs

    def _may_grow(self, rows: int, slots: int) -> None:
        """Refuse a KV cache growth past the device's free memory (MemoryShortError) before it is allocated: raised
        in a pass, it is an error of the batch's rows (which a job's actor then runs again in halves) rather than
        CUDA's out-of-memory error or, on a CPU, a process the kernel kills without a word."""
        require(f"a KV cache of {rows} rows of {slots} positions", rows * slots * self.slot_bytes,
                "lower engine.max_batch_size, or shorten the rows (prompt and generation.max_new_tokens)", self.device)

    def _forward_tokens(self) -> float:
        """engine.prefill_forward_tokens resolved: on CUDA measured once per loaded model (every engine over it then
        chunks the same prompts alike)."""
        value = self.cfg.prefill_forward_tokens
        if value != "auto":
            return float(value)
        if self.device.type != "cuda":
            return CPU_FORWARD_TOKENS
        if self.loaded.prefill_cost is None:
            self.loaded.prefill_cost = measure_prefill_cost(self.runner)
            log.info("prefill: a forward costs %.1f ms and a token %.1f us: one forward = %.0f padded tokens",
                     1e3 * self.loaded.prefill_cost.fixed_s, 1e6 * self.loaded.prefill_cost.token_s,
                     self.loaded.prefill_cost.forward_tokens)
        return self.loaded.prefill_cost.forward_tokens

    def _admission(self) -> Admission:
        """engine.admission resolved: `auto` weighs idle slots against a prefill forward's fixed cost where that cost
        is measured (on CUDA, once per loaded model), else requests join at once."""
        if self.cfg.admission != "auto":
            return Admission()
        if self.loaded.prefill_cost is None and self.device.type == "cuda":
            self.loaded.prefill_cost = measure_prefill_cost(self.runner)
        return Admission(self.loaded.prefill_cost.fixed_s if self.loaded.prefill_cost is not None else 0.0)

    def _policy(self, cost_curve: Optional[CostCurve]) -> Optional[BlockPolicy]:
        """block_complexity=auto's policy over the drafter's sizes (None: a fixed size, or nothing to size)."""
        cfg = self.cfg
        if not self.auto or not isinstance(self.drafter, DraftSizer):
            return None
        # with CUDA graphs the curve is that of replayed passes (on a CPU the static path runs eagerly: the
        # eager forward's curve serves)
        passes = self.graphs.pass_timer if self.graphs is not None and self.graphs.capture else None
        kind = "graphs+compiled" if cfg.cuda_graphs_compile else "graphs"
        curve = cost_curve or calibrate(self.runner, cfg.max_batch_size, cfg.auto_max_block, cfg.cost_curve_path,
                                        passes, kind)
        prepare = PREPARE_LOOKS if PREPARE_LOOKS is not None else self.device.type != "cpu"
        settings = PolicySettings(probe_interval=cfg.auto_probe_interval, prepare_looks=prepare)
        return BlockPolicy(curve, self.drafter, cfg.auto_max_block, settings)

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, engine_cfg: EngineConfig) -> "Engine":
        engine_cfg.validate()
        return cls(load_model(model_cfg), engine_cfg)

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # ---- public API --------------------------------------------------------------------------------
    @property
    def compile_s(self) -> float:
        """Seconds spent compiling under engine.compile and capturing under engine.cuda_graphs (0 without them)."""
        direct = self.runner.direct
        layers = direct.compiled.compile_s if direct is not None and direct.compiled is not None else 0.0
        return layers + (self.graphs.stats.capture_s if self.graphs is not None else 0.0)

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
        self._requests = _Requests(requests)
        take = self._requests.take
        self.drafter.start_job()
        if self.graphs is not None:  # the pinned slab the graphs read, emptied
            self.graphs.cache.select_rows([])
        cache = self.graphs.cache if self.graphs is not None else kv_cache.new_cache(self.num_layers)
        cache.before_growth = self._may_grow
        rows = Rows([], RowTensors(), self.drafter.state_type(), UniformStreams(self.device), cache)
        self._in_flight = None
        self.admission.joined()
        self._exhausted = False
        while True:
            admit: list[Seq] = []
            live = rows.live()
            if not self._exhausted and live < self.max_rows and self.admission.due(live):
                if live < len(rows):  # ended rows kept in the batch (`_keeps_ended`) leave first
                    self._land(rows)
                    yield from self._retire(rows)
                reqs, self._exhausted = take(self.max_rows - len(rows), not len(rows))
                if reqs:  # rows join: the pass in flight is read first
                    self._land(rows)
                    self.admission.joined()
                for req in reqs:
                    prepared = self._prepare(req)
                    if isinstance(prepared, RequestOutput):
                        yield prepared
                    else:
                        admit.append(prepared)
            for chunk in self._prefill_chunks(admit):
                rows.extend(self._prefill(chunk, rows))
                self.planner.rows_changed()
            yield from self._retire(rows)
            if not len(rows):
                if self._exhausted:
                    return
                continue
            live = rows.live()
            self.stats.batch_histogram[live] += 1
            free, start = self.max_rows - live, now()
            self._step(rows)
            self.admission.passed(free, now() - start)
            yield from self._retire(rows)

    # ---- admission ---------------------------------------------------------------------------------
    def _error(self, req_id: str, msg: str) -> RequestOutput:
        return RequestOutput(id=req_id, token_ids=[], text="", finish_reason=None, stats=RequestStats(), error=msg)

    def _prepare(self, req: Request) -> Union[Seq, RequestOutput]:
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
        if params.n != 1:
            return self._error(rid, f"n={params.n}: the engine decodes one sample per request (make the n requests "
                                    "with esp_worker.sample_requests)")
        seed = params.seed if params.seed is not None else default_seed(self.cfg.seed, rid)
        stats = RequestStats(num_prompt_tokens=len(ids))
        return Seq(req=Request(rid, req.prompt, ids, params), prompt_ids=ids, seed=seed, stats=stats)

    def _prefill_chunks(self, seqs: list[Seq]) -> Iterator[list[Seq]]:
        """Admitted sequences in prefill forwards, longest first: the chunks that minimise forwards x
        prefill_forward_tokens + padded tokens, each within `prefill_batch_tokens` padded tokens (prefill_plan.py).
        A prompt's length here is what its prefill feeds: less its stored prefix (prefix_cache.py)."""
        if self.prefixes is not None and seqs:
            self.prefixes.assign(seqs, [r.prompt_ids for r in self._requests.upcoming(self.prefixes.lookahead)
                                        if r.prompt_ids is not None])
        fed = [len(s.prompt_ids) - (0 if s.prefix is None else s.prefix.length) for s in seqs]
        plan = plan_chunks(fed, self.prefill_forward_tokens, self.cfg.prefill_batch_tokens)
        for chunk in plan:
            yield [seqs[i] for i in chunk]

    def _new_rows(self, seqs: list[Seq], cache: kv_cache.KVCache) -> Rows:
        dev = self.device
        lens = [len(s.prompt_ids) for s in seqs]
        cap = max(lens) + 64
        hist = torch.zeros((len(seqs), cap), dtype=torch.long)
        for i, s in enumerate(seqs):
            hist[i, : lens[i]] = torch.tensor(s.prompt_ids)
            s.passes0, s.sizes0 = self.stats.blocks.passes, dict(self.stats.blocks.sizes)
        p = [s.req.params for s in seqs]
        extra = [list(x.stop_token_ids) + ([] if x.ignore_eos else self.eos.tolist()) for x in p]
        width = max(1, max(len(e) for e in extra))
        stop_ids = torch.full((len(seqs), width), -1, dtype=torch.long)
        for i, e in enumerate(extra):
            stop_ids[i, : len(e)] = torch.tensor(e, dtype=torch.long)
        plen = torch.tensor(lens)
        top = max(x.top_logprobs for x in p)  # the alternatives' columns (grown when rows asking for more join)
        limit, limit_code = row_limits(plen + torch.tensor([x.max_new_tokens for x in p]), self.loaded.max_context)
        t = RowTensors(
            hist=hist.to(dev),
            logprobs=torch.zeros(hist.shape, dtype=torch.float32, device=dev),
            top_ids=torch.zeros((*hist.shape, top), dtype=torch.int32, device=dev),
            top_logprobs=torch.zeros((*hist.shape, top), dtype=torch.float32, device=dev),
            hist_len=plen.to(dev),
            prompt_len=plen.to(dev),
            limit=limit.to(dev),
            limit_code=limit_code.to(dev),
            temperature=torch.tensor([float(x.temperature) for x in p], device=dev),
            top_p=torch.tensor([float(x.top_p) for x in p], device=dev),
            top_k=torch.tensor([int(x.top_k) for x in p], device=dev),
            stop_table=stop_table(stop_ids, self.num_logits).to(dev),
            **new_counters(len(seqs), dev, len(self.drafter.proposers)),
        )
        uni = UniformStreams(dev)
        uni.append([UniformStreams.generator(s.seed) if x.temperature > 0 else None for s, x in zip(seqs, p)])
        reason = torch.zeros(len(seqs), dtype=torch.long, device=dev)
        return Rows(seqs, t, self.drafter.state_type(), uni, cache, reason, lens=list(lens), done=[0] * len(seqs),
                    limits=limit.tolist())

    # ---- prefill -----------------------------------------------------------------------------------
    @inference
    def _prefill(self, seqs: list[Seq], batch: Rows) -> Rows:
        """Prefill `seqs` into rows len(batch) .. of the batch's cache; returns their rows (not yet joined)."""
        now = time.perf_counter()
        for s in seqs:
            s.t0 = now
        cache = batch.cache
        rows = self._new_rows(seqs, cache)
        dev = self.device
        aux = self.drafter.start_rows(rows.view())  # [R, A, D] masks owned by the last prompt token, or None
        lens = rows.t.prompt_len
        r, row0 = len(seqs), len(batch)
        scored = any(s.req.params.prompt_logprobs for s in seqs)  # every position's hidden state is read
        # slots of each row its prefill does not feed: its stored prefix, copied into its cache row (prefix_cache.py)
        reuse = [0 if scored or s.prefix is None else s.prefix.length for s in seqs]
        if self.prefixes is None or not self.prefixes.worth(sum(reuse), sum(rows.lens)):  # too little to pay a mask
            reuse = [0] * r
        fmax = max(n - u for n, u in zip(rows.lens, reuse))  # tokens fed to a row, at most
        a = 0 if aux is None else aux.shape[1]
        q = fmax + a
        view = max(reuse) + q  # slots the forward sees
        # each row's block: its prompt from slot reuse[r] on, its masks right after it (ESP's, block index
        # fed + j, position len + j), then padding; so each token sees just its own prompt (and earlier masks)
        start = torch.tensor(reuse, device=dev)  # [R]
        fed = lens - start  # [R]
        if any(reuse):
            at = (start[:, None] + steps(fmax, dev)[None]).clamp(max=rows.t.hist.shape[1] - 1)  # [R, F]
            ids = rows.t.hist.gather(1, at)
        else:
            ids = rows.t.hist[:, :fmax]
        embeds = self.runner.embed_ids(ids)
        mask_at = fed[:, None] + steps(a, dev)  # [R, A]
        if a:
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, a))
            embeds.scatter_(1, mask_at[..., None].expand(-1, -1, embeds.shape[2]), aux.to(embeds.dtype))
        i = steps(q, dev)
        pos = (start[:, None] + i[None]).clamp(max=self.loaded.max_context - 1)  # [R, Q]
        cache.reserve(row0 + r, max([view] + [n + 1 for n in batch.lens]))
        for prefix in {s.prefix.ids: s.prefix for s, u in zip(seqs, reuse) if u}.values():
            cache.write_prefix([row0 + k for k, s in enumerate(seqs) if reuse[k] and s.prefix.ids == prefix.ids],
                               prefix.kv)
        uniform = len(set(reuse)) == 1
        cache.plan(row0, r, view, reuse[0] if uniform else start)
        window = self.runner.sliding_window
        causal = (i[:, None] >= i[None, :])[None]  # [1, Q, Q]
        if not any(reuse) and not self.runner.prefill_needs_mask:
            # plain causal attention, no mask tensor (on CUDA SDPA may then take its flash backend): the padding's
            # outputs are never read, and its cache slots (like the masks') lie past the row's length
            bias = None
        elif any(reuse) and uniform and window is None:
            # every row's stored prefix has one length: one bias [1, 1, Q, S] for all rows, the prefix then causal
            # (a row's padding lies after its tokens, where causal attention never looks)
            bias = attention_bias(causal, start[:1], pos[:1], view, self.runner.dtype, uniform_len=reuse[0])
        else:
            require(f"a prefill of {r} prompts of up to {fmax} tokens (its attention mask, {r} x {q} x {view})",
                    r * q * view * (2 + self.runner.dtype.itemsize), "lower engine.prefill_batch_tokens", dev)
            key_ok = i[None] < (fed + a)[:, None]  # [R, Q] the row's prompt and masks, not its padding
            visible = causal & key_ok[:, None, :]  # [R, Q, Q]
            visible |= torch.eye(q, dtype=torch.bool, device=dev)[None]  # padding rows see themselves
            # with stored prefixes, each row's is its queries' cached part
            bias = attention_bias(visible, start if any(reuse) else None, pos, view, self.runner.dtype, window)
        wanted = torch.cat([fed[:, None] - 1, mask_at], 1)  # [R, 1 + A] last prompt token, masks
        forward = self.runner.forward if self.cycle is None else self.cycle.prefill
        hidden = forward(embeds, bias, pos, cache, view - 1, keep=None if scored else wanted)  # [R, 1 + A, D]
        if scored:  # the prompts' own log-probabilities, beside where their generated tokens' go
            rows.t.logprobs[:, 1:fmax] = prompt_logprobs(self.runner.logits, hidden, ids, self.num_logits)
            hidden = gather_slots(hidden, wanted)
        if self.prefixes is not None:
            self.prefixes.capture(seqs, row0, cache)
        self.stats.prefill_tokens += sum(rows.lens) - sum(reuse)
        self.stats.prefill_cached_tokens += sum(reuse)
        for s, u in zip(seqs, reuse):
            s.stats.num_cached_prompt_tokens = u
        last = hidden[:, 0]  # [R, D]
        logits = self.runner.logits(last)  # [R, V]
        rows.uniforms.ensure(1, rows.consumed())
        tok = self._chooser(rows)(logits, torch.ones(r, dtype=torch.bool, device=dev))
        committed = tok[:, None]
        n = torch.ones(r, dtype=torch.long, device=dev)
        n_fin, reason = self._stops(rows, committed, n)
        top = rows.logprobs_top
        self._commit(rows, committed, n_fin, reason, tok,
                     None if top is None else chosen_logprobs(logits[:, None], committed, top))
        aux_hidden = hidden[:, 1:] if a else None
        mask_hidden = aux_hidden[:, : self.drafter.num_masks] if a and self.drafter.num_masks else None
        self.drafter.observe(rows.view(), PassRecord(committed, n_fin, hidden=aux_hidden, mask_hidden=mask_hidden,
                                                     prefill=True, trunk=self.runner.tapped))
        rows.read_back(self.drafter.row_hints(rows.view()))
        self.stats.prefill_forwards += 1
        self.stats.prefill_s += time.perf_counter() - now
        return rows

    # ---- one decode pass ---------------------------------------------------------------------------
    @inference
    def _step(self, rows: Rows) -> None:
        """One decode pass over every row; the host reads the device once, at its end."""
        if self._runs_ahead(rows):
            self._step_ahead(rows)
            return
        self._land(rows)
        if any(rows.done):  # the pass in flight ended rows: they retire first
            return
        clock = self.stats.start(self.runner.model_s, self.compile_s if self.policy is not None else 0.0, rows.lens)
        view = rows.view()
        block = self.drafter.propose(view, self.planner.plan(view, rows.lens))
        graphed = self._replay(rows, block) if self.graphs is not None else None
        if graphed is not None:  # engine.cuda_graphs: forward and settle replayed over the class's buffers
            out, settled = graphed.out, self._finish(rows, block, graphed.verified, graphed.num_kept, graphed.reason)
            settled.probe = graphed.probe
        elif self.cycle is not None:  # engine.method=dmtd: a cycle of tau tokens
            out, settled = self._cycle(rows, block)
        else:
            out = self._forward(rows, block)
            settled = self._settle(rows, block, out)
        view = rows.view()  # after the commit
        self.drafter.observe(view, self._record(block, out, settled))
        self._end_pass(rows, view, block, clock)

    # ---- passes run ahead of their reads (engine.cuda_graphs_run_ahead) ----------------------------------
    def _runs_ahead(self, rows: Rows) -> bool:
        """Whether this batch's passes may run ahead: replayed passes, which need nothing from the pass before but
        what is on the device (its tokens, lengths, the drafter's state) and a bound on its lengths (the most it can
        commit), with nothing the host must check between passes (stop strings). Under block_complexity=auto the
        policy plans each pass from the read before the one in flight (`BlockPolicy.plan`). Drafting passes run
        ahead over greedy rows only: a sampling row's uniforms are refilled at a host-known position."""
        return (self.cfg.cuda_graphs_run_ahead is not False and self.graphs is not None
                and self.cycle is None and not rows.has_stop_strings
                and (isinstance(self.drafter, PlainDrafter) or not rows.sampling))

    def _step_ahead(self, rows: Rows) -> None:
        """A pass launched before the host reads the one in flight, then that one's read. The pass in flight may have
        ended rows: this one runs over them too, committing and counting nothing there (its settle is masked by their
        finish reasons, on the device), and is then read at once. Meanwhile the host's lengths are bounds, one pass
        ahead: each row that goes on gains at most the pass's width (a plain pass: exactly one token)."""
        before = self._in_flight
        if before is not None and self.planner.wants_read():  # the plan needs the look that rides in that read
            self._land(rows)
            before = None
            if any(rows.done):
                return  # rows ended: they retire before the next pass
        clock = self.stats.start(self.runner.model_s, self.compile_s if self.policy is not None else 0.0, rows.lens)
        mark = self.runner.clock.mark() if self.policy is not None else None
        view = rows.view()
        block = self.drafter.propose(view, self.planner.plan(view, rows.lens))
        graphed = self._replay(rows, block)
        if graphed is None:  # no graph for this pass: read the one in flight, then run it as any other
            self._land(rows)
            if any(rows.done):
                self.graphs.withdraw()
                return  # rows ended: they retire before the next pass (this one did not run)
            out = self._forward(rows, block)
            settled = self._settle(rows, block, out)
            self.drafter.observe(rows.view(), self._record(block, out, settled))
            self._end_pass(rows, rows.view(), block, clock)
            return
        live = None if before is None else rows.reason.eq(0)  # [B] rows the pass in flight did not end
        settled = self._finish(rows, block, graphed.verified, graphed.num_kept, graphed.reason, live)
        settled.probe = graphed.probe
        self.drafter.observe(rows.view(), self._record(block, graphed.out, settled, live))
        self.stats.blocks.add(block.num_inputs)
        width = block.max_depth + 1
        rows.hints = None  # the drafter's row hints come with reads: the next pass is proposed before this one's
        look = self.planner.prepare(rows.view(), rows.lens)  # a coming pass's look: its mass rides in this read
        timing = None
        if mark is not None:
            timed = self.compile_s == clock.compile_s and not self.graphs.last_uncaptured
            timing = _PassTiming(clock.seconds() if timed else None, (mark, self.runner.clock.mark()))
        self._in_flight = _InFlight(PendingRead.of(rows, look), rows.lens, block.num_inputs, width, timing)
        rows.lens = [n + width for n in rows.lens]  # the most the pass commits in every row that goes on
        rows.lens_exact = rows.lens_exact and width == 1
        if before is not None:
            self.stats.graphs.ahead_passes += 1
            if any(rows.done):
                self.stats.graphs.kept_ended_passes += 1
            self._read(rows, before)
            if any(rows.done) and not self._keeps_ended(rows):  # the pass just launched ran over rows that had
                self._land(rows)  # ended: read it too, and they leave
        ending = [limit for n, limit, code in zip(rows.lens, rows.limits, rows.done) if not code and n >= limit]
        if ending and (max(ending) >= self.loaded.max_context or not self._keeps_ended(rows, len(ending))):
            self._land(rows)  # it may end rows at their limits, which would leave: read it before the next pass
        self.stats.finish(clock, self.runner.model_s)

    def _keeps_ended(self, rows: Rows, ending: int = 0) -> bool:
        """Whether rows that ended stay in the batch while passes run on: each pass runs over them masked (it
        commits and counts nothing there), and they leave with the next join. Reading the pass in flight to let
        them leave at once would leave the device idle while the host retires them and builds the next pass, once
        for every row that ends. They stay while no request would join yet (`engine.admission`; none is left),
        some row is live and the live rows alone would take the same graph (the same batch bucket). Under
        block_complexity=auto the policy's looks leave them out (`RowsView.going`) and it learns from the rows each
        pass could commit to, at the cost of the whole batch. ending: rows the pass just launched may end besides
        (at their length limits), counted as ended: where they would not stay, that pass is read before the next is
        launched, so that they leave (and requests join) at once."""
        live = rows.live() - ending
        joins = not self._exhausted and self.admission.due(live)
        return 0 < live and not joins and self.graphs.bucket(live) == self.graphs.bucket(len(rows))

    def _land(self, rows: Rows) -> None:
        """The read of the pass in flight, if any (its lengths and finish reasons are the rows' from here)."""
        if self._in_flight is not None:
            self._read(rows, self._in_flight)

    def _read(self, rows: Rows, sent: _InFlight) -> None:
        """Take pass `sent`'s read. Rows that had ended before it (`rows.done`: it ran over them) got nothing from
        it, and their requests do not count it. With a pass still in flight after `sent`, the live rows' lengths
        stay bounds one pass ahead (`sent`'s lengths are that pass's start)."""
        ended = rows.done
        lens, done, look = sent.read.get()
        self.planner.receive(look)
        if self._in_flight is sent:
            self._in_flight = None
        committed = 0
        for r, (s, new, old) in enumerate(zip(rows.seqs, lens, sent.lens)):
            if ended[r]:
                s.passes0 += 1  # this pass is not the request's
                s.sizes0[sent.size] = s.sizes0.get(sent.size, 0) + 1
            else:
                s.stats.committed_per_pass.append(new - old)
                committed += new - old
        if self.policy is not None:
            seconds, model_s = (None, None) if sent.timing is None else sent.timing.read(self.runner.clock)
            self.policy.observe_pass(committed, seconds, model_s, rows=rows.live())  # (rows.done: `ended` still)
        nxt = self._in_flight
        if nxt is not None:
            nxt.lens = lens
        rows.lens = [n if code else n + nxt.width for n, code in zip(lens, done)] if nxt is not None else lens
        rows.lens_exact = nxt is None or nxt.width == 1
        rows.done = done
        rows.hints = None

    def _forward(self, rows: Rows, block: Block) -> ForwardOut:
        """The block through the model: hidden states and the tree slots' logits; writes the block's KV."""
        tree = block.tree
        embeds = self.runner.embed_ids(tree.tokens)  # [B, T, D]
        if block.aux_embeds is not None:
            aux = block.aux_embeds
            embeds = torch.cat([embeds, aux if aux.dtype == embeds.dtype else aux.to(embeds.dtype)], 1)
        place = self._place(rows, block, embeds.shape[1])
        hidden = self.runner.forward(embeds, place.bias, place.pos, rows.cache, place.view_len - 1)
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, rows.cache.nbytes())
        return ForwardOut(hidden, self.runner.logits(hidden.narrow(1, 0, tree.num_slots)))

    def _place(self, rows: Rows, block: Block, q: int, ahead: int = 0) -> Placement:
        """Where a block of q inputs per row goes: positions, the attention bias and the cache plan (written
        here). `ahead`: tokens the rows have gained in this pass beyond their host lengths (DMTD's cycle)."""
        tree, lay = block.tree, block.layout
        b = len(rows.lens)
        common = rows.common_length()
        s_max = (max(rows.lens) if common is None else common) - 1 + ahead  # cached slots per row (not the root)
        if common is not None:  # rows of one length (batch 1 always): positions from the host-known length
            cache_len, pos = None, lay.rel_pos + s_max  # [B|1, Q]
            if pos.shape[0] != b:
                pos = pos.expand(b, -1)
        else:
            cache_len = rows.t.hist_len + (ahead - 1)  # [B]
            pos = cache_len.unsqueeze(1) + lay.rel_pos  # [B, Q]
        if s_max + q > self.loaded.max_context:  # positions past the context (rows that stop there) are clamped
            pos = pos.clamp(max=self.loaded.max_context - 1)
        view_len = s_max + q
        rows.cache.reserve(b, view_len)
        rows.cache.plan(0, b, view_len, s_max if cache_len is None else cache_len)  # rows of one length: a slice write
        if q == 1 and common is not None and self.runner.sliding_window is None:
            bias = None  # plain decoding, rows of one length: every slot of the view is visible (no mask)
        elif common is not None and self.runner.sliding_window is None and tree.static_key is not None:
            bias = self._static_bias((tree.static_key, lay.num_masks), lay.visible, s_max, b, self.runner.dtype)
        else:
            if cache_len is None and self.runner.sliding_window is not None:  # the window needs each key's position
                cache_len = rows.t.hist_len + (ahead - 1)
            bias = attention_bias(lay.visible, cache_len, pos, view_len, self.runner.dtype, self.runner.sliding_window,
                                  uniform_len=None if common is None else s_max)
        return Placement(pos, bias, view_len)

    def _cycle(self, rows: Rows, block: Block) -> tuple[ForwardOut, Settled]:
        """engine.method=dmtd: one pass is one cycle of tau tokens per row, each token from the last through the
        layers its position runs (model/dmtd.py), chosen on the device and fed to the next, with no host read
        in between: the engine's per-pass work (stops, commit, counters, the host read) is paid once per cycle,
        as the direct mode's loop does. Each row meets one cycle start among tau consecutive positions, where it
        also refills the thinking layers over its last tau tokens, the ones of this cycle written to its history
        as they are chosen. Stops cut the cycle as they cut a speculative pass (tokens past them are dropped)."""
        tau, t = self.cycle.cfg.tau, rows.t
        b = len(rows.lens)
        rows.ensure_capacity(tau)
        if rows.sampling:
            rows.uniforms.ensure(tau, rows.consumed())
        choose, every = self._chooser(rows), torch.ones(b, dtype=torch.bool, device=self.device)
        common = rows.common_length()
        tok, chosen, chosen_lp = block.tree.tokens[:, 0], [], []  # [B] the roots, then each token chosen
        top = rows.logprobs_top
        for j in range(tau):
            place = self._place(rows, block, 1, ahead=j)
            lens = [n + j for n in rows.lens]
            starts = CycleStarts.of(lens, t.hist, t.hist_len + j, tau)
            hidden = self.cycle.step(self.runner.embed_ids(tok[:, None]), place.bias, place.pos, rows.cache,
                                     place.view_len - 1, starts)  # [B, 1, D]
            logits = self.runner.logits(hidden)  # [B, 1, V]
            tok = choose(logits[:, 0], every)
            chosen.append(tok)
            if top is not None:
                chosen_lp.append(chosen_logprobs(logits, tok[:, None], top))
            if j + 1 < tau:  # into the history at its position: a later cycle start's refill reads it there
                if common is not None:
                    t.hist.narrow(1, common + j, 1).copy_(tok[:, None])
                else:
                    t.hist.scatter_(1, (t.hist_len + j)[:, None], tok[:, None])
        self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, rows.cache.nbytes())
        committed = torch.stack(chosen, 1)  # [B, tau]
        n = torch.full((b,), tau, dtype=torch.long, device=self.device)
        path = steps(tau, self.device)[None].expand(b, -1)  # the cycle's KV are in place: no keep
        res = VerifyResult(committed, n, path, path[:, -1], last_token=tok,
                           logprobs=TokenLogprobs.cat(chosen_lp) if chosen_lp else None)
        n_fin, reason = self._stops(rows, committed, n)
        self._commit(rows, committed, n_fin, reason, tok, res.logprobs)
        rows.count(n_fin, n, None, tau)
        return ForwardOut(hidden, logits), Settled(res, n_fin, reason)

    def _settle(self, rows: Rows, block: Block, out: ForwardOut) -> Settled:
        """Verification, stops, the KV moves, the commit and the counters."""
        top = rows.logprobs_top
        res = self._verify(rows, block, out.slot_logits)
        if top is not None:
            res.logprobs = path_logprobs(out.slot_logits, res.path_slots, res.committed, top)
        n_fin, reason = self._stops(rows, res.committed, res.num_committed)
        rows.keep_path(block.tree, res.path_slots)
        return self._finish(rows, block, res, n_fin, reason)

    def _finish(self, rows: Rows, block: Block, res: VerifyResult, n_fin: torch.Tensor, reason: torch.Tensor,
                live: Optional[torch.Tensor] = None) -> Settled:
        """The settle's end, after verification, stops and the KV keep: the commit and the counters. live [B] bool:
        the rows the pass may commit to (None: all); the others keep their lengths and finish reasons."""
        if live is not None:
            n_fin, reason = n_fin * live, torch.where(live, reason, rows.reason)
        self._commit(rows, res.committed, n_fin, reason, res.last_token, res.logprobs)
        rows.count(n_fin, res.num_committed, block.tree.num_drafted(), block.max_depth + 1, block.source, res.path_slots,
                   live)
        return Settled(res, n_fin, reason)

    def _replay(self, rows: Rows, block: Block) -> Optional[GraphPass]:
        """The pass's forward and settle from its shape class's graph (`graphs/runner.py`), timed as model time;
        None = it runs eagerly."""
        hooks = self.drafter if isinstance(self.drafter, StepHooks) and self.cfg.cuda_graphs_probe else None
        probe = hooks.step_probe(rows.view(), block) if hooks is not None else None
        with self.runner.timing("model.graph"):
            graphed = self.graphs.run(rows, block, probe)
        if graphed is not None:
            self.stats.peak_cache_bytes = max(self.stats.peak_cache_bytes, rows.cache.nbytes())
            took = graphed.probe is not None and graphed.probe.path_lp is not None  # what the drafter reads of them
            if self.drafter.reads_slot_logits and not took:  # the graph keeps no logits: the LM head again, at the slots
                graphed.out.slot_logits = self.runner.logits(graphed.out.hidden.narrow(1, 0, block.tree.num_slots))
        return graphed

    def _verify(self, rows: Rows, block: Block, slot_logits: torch.Tensor) -> VerifyResult:
        if rows.sampling:
            rows.uniforms.ensure(block.max_depth + 1, rows.consumed())
            return verify(block.tree, slot_logits, block.max_depth, self._chooser(rows))
        return verify_greedy(block.tree, slot_logits, block.layout.visible, block.layout.depth, block.max_depth)

    def _record(self, block: Block, out: ForwardOut, settled: Settled, live: Optional[torch.Tensor] = None) -> PassRecord:
        """What the drafter learns from the pass: with masks, the hidden states of those the last accepted slot
        owns (gathered here unless the replayed pass ran the probe itself). live [B]:
        the rows the pass counted for (a pass run ahead over rows the one before ended; None: all)."""
        res, k = settled.verified, self.drafter.num_masks
        mask_hidden, mask_ok = None, None  # [B, k, D], [B]
        probed = settled.probe is not None and settled.probe.probed
        if probed:
            mask_ok = settled.probe.mask_ok
        elif k and block.aux_embeds is not None:
            owner = res.last_slot
            if block.mask_owner is not None:  # masks on some slots only (hybrid)
                owner = block.mask_owner.expand(len(owner), -1).gather(1, owner[:, None]).squeeze(1)
                mask_ok = owner >= 0
                owner = owner.clamp(min=0)
            mask_hidden = gather_slots(out.hidden, mask_indices(owner, block.tree.num_slots, k))
        return PassRecord(res.committed, settled.num_kept, hidden=out.hidden, mask_hidden=mask_hidden,
                          slot_logits=out.slot_logits, path_slots=res.path_slots, last_slot=res.last_slot, block=block,
                          mask_ok=mask_ok, probe=settled.probe, trunk=self.runner.tapped,
                          live=live)

    def _end_pass(self, rows: Rows, view: RowsView, block: Block, clock: PassClock) -> None:
        """The pass's one host read (lengths, finish reasons, the drafter's row hints and the planner's next look),
        then its counters. Hints serve the next lookup: none before a pass known to be plain."""
        self.stats.blocks.add(block.num_inputs)
        look = self.planner.prepare(view, rows.lens)
        hints = None if self.planner.next_is_plain() else self.drafter.row_hints(view)
        before = rows.lens
        self.planner.receive(rows.read_back(hints, look))
        for s, new, old in zip(rows.seqs, rows.lens, before):  # each row's committed tokens, from the host mirrors
            s.stats.committed_per_pass.append(new - old)
        seconds, model_s = self.stats.finish(clock, self.runner.model_s)
        if self.policy is not None:
            # a pass that compiled a kernel or captured a graph, or ran eagerly before its class's capture, says
            # nothing of its mode's cost: not timed
            timed = self.compile_s == clock.compile_s and not (self.graphs is not None and self.graphs.last_uncaptured)
            self.policy.observe_pass(sum(rows.lens) - clock.tokens, seconds if timed else None,
                                     model_s if timed else None)

    # ---- helpers -----------------------------------------------------------------------------------
    def _chooser(self, rows: Rows):
        t = rows.t
        sampling = rows.sampling

        def choose(logits: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
            u = rows.uniforms.take(active) if sampling else None
            return choose_tokens(logits, t.temperature, t.top_p, t.top_k, u)

        return choose

    def _stops(self, rows: Rows, committed: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_final [B], reason [B]) after stop ids, lengths, the context limit and stop strings."""
        t = rows.t
        far = min(map(operator.sub, rows.limits, rows.lens), default=0) > committed.shape[1]  # host mirrors: no read
        n_fin, reason = apply_stops(committed, n, t.stop_table, t.hist_len, t.limit, t.limit_code, far)
        if rows.has_stop_strings:
            stops = [s.req.params.stop_strings for s in rows.seqs]
            gen = [t.hist[r, len(s.prompt_ids): rows.lens[r]].tolist() if stops[r] else [] for r, s in enumerate(rows.seqs)]
            n_fin, reason = apply_stop_strings(self.tokenizer, stops, gen, committed, n_fin, reason)
        return n_fin, reason

    def _commit(self, rows: Rows, committed: torch.Tensor, n_fin: torch.Tensor, reason: torch.Tensor,
                last_token: Optional[torch.Tensor] = None, logprobs: Optional[TokenLogprobs] = None) -> None:
        """committed [B, S] (and their log-probabilities, when computed) into the rows' history; the rows advance
        by n_fin with their finish reasons."""
        t = rows.t
        s = committed.shape[1]
        rows.ensure_capacity(s)  # room for s more tokens behind every row (host-known lengths)
        # all s slots are written: those past n_fin lie beyond the new length, where a row's slots are stale
        # anyway (every reader of `hist` stops at hist_len)
        length = rows.common_length()
        lp = (None,) * 3 if logprobs is None else logprobs.tensors()
        for into, values in zip((t.hist, t.logprobs, t.top_ids, t.top_logprobs), (committed, *lp)):
            if values is None:
                continue
            if length is not None:  # rows of one length (host-known): one slice
                into = into.narrow(1, length, s)
                (into if values.ndim == 2 else into.narrow(2, 0, values.shape[2])).copy_(values)
            else:
                write_history(into, t.hist_len, values)
        rows.advance(t.hist_len + n_fin, last_token, reason)  # last_token: the next roots, where verification gave them

    def _retire(self, rows: Rows) -> Iterator[RequestOutput]:
        """Outputs of the rows that finished (known on the host since the last read_back); they leave the batch."""
        done = [r for r, code in enumerate(rows.done) if code]
        if not done or self._in_flight is not None:  # (ended rows kept while a pass runs over them leave later)
            return
        now = time.perf_counter()
        for r, fin in zip(done, rows.read_finished(done)):
            s, ids = rows.seqs[r], fin.token_ids
            self.drafter.finish_request(s.prompt_ids + ids)
            finish_stats(s.stats, fin.drafted, fin.hists, len(ids), *self.stats.blocks.since(s))
            if self.cycle is not None:
                s.stats.num_layers_run = self.cycle.cfg.layers_run(len(s.prompt_ids), len(ids))
                s.stats.num_model_layers = self.num_layers
            if self.drafter.proposers:
                s.stats.accepted_by_proposer = dict(zip(self.drafter.proposers, fin.accepted_by))
            s.stats.time_s = now - s.t0
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            yield RequestOutput(id=s.req.id, token_ids=ids, text=text, finish_reason=REASONS[rows.done[r]], stats=s.stats,
                                logprobs=fin.logprobs, top_logprobs=fin.top_logprobs,
                                prompt_logprobs=fin.prompt_logprobs)
        rows.drop(done)
        self.planner.rows_changed()

