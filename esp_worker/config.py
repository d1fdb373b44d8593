"""Engine and model configuration (plain dataclasses: the engine knows nothing of OmegaConf)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

METHODS = ("ar", "esp", "pld", "stand", "lade", "hybrid", "cp_heads", "dmtd", "dmtd_verified")
# methods whose output is not the model's own decoding (a different model): exempt from the lossless rule, and
# marked wherever their output goes (RequestOutput rows' `lossless`, job summaries, reports)
NOT_LOSSLESS = ("dmtd",)
# methods the block size does not apply to: DMTD's cycle length tau sets what a pass feeds
CYCLE_METHODS = ("dmtd", "dmtd_verified")
TREES = ("static", "dynamic")
EXPANSIONS = ("top1", "frontier")
MASK_INITS = ("mean", "last_k", "sample", "offset")
DTYPES = ("float32", "bfloat16", "float16", "auto")
ATTN_IMPLS = ("sdpa", "eager")
ATTENTION_BACKENDS = ("torch", "cudnn", "efficient", "math", "flex")  # engine.attention_backend
TINY_PREFIX = "tiny-random-"  # model names built in code, never read from a directory
RANDOM_PREFIX = "random:"
# Lookahead decoding's sizes (N, W, G) for a block complexity, the paper's Appendix F: (N - 1)(W + G) = BC
LADE_PAPER_SIZES = {10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)}


def lade_sizes(block_complexity: int) -> tuple[int, int, int]:
    """(N, W, G) for a block complexity: the paper's table, else a rule that fits (N - 1)(W + G) <= BC.

    Rule: N = 3 below BC 30, 4 below 60, else 5; W + G = BC // (N - 1) split W = ceil(half), G = the rest.
    Examples: 10 -> (3, 4, 1); 20 -> (3, 5, 5); 45 -> (4, 8, 7); 120 -> (5, 15, 15).
    (Here, not beside the drafter, so that a job's driver checks a lade config without importing torch.)
    """
    if block_complexity in LADE_PAPER_SIZES:
        return LADE_PAPER_SIZES[block_complexity]
    n = 3 if block_complexity < 30 else 4 if block_complexity < 60 else 5
    width = block_complexity // (n - 1)
    if width < 2:
        raise ValueError(f"engine.block_complexity={block_complexity} is too small for lade; use at least 4")
    w = math.ceil(width / 2)
    return n, w, width - w


@dataclass
class ModelConfig:
    # Local path, hub id, "tiny-random-<arch>" (llama | qwen2 | qwen3 | mistral) for offline demos/tests, or
    # "random:<shape>" (llama-1b | llama-3b | llama-8b | qwen3-1.7b | qwen3-8b | path/to/config.json): real-size
    # architecture, random weights, offline (throughput and cost curves only).
    name_or_path: str = "tiny-random-llama"
    dtype: str = "float32"  # float32 | bfloat16 | float16 | auto
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    attn_implementation: str = "sdpa"  # sdpa | eager (flash_attention_2 cannot take tree masks)
    # Llama / Mistral / Qwen2 / Qwen3: run the decoder layers directly (esp_worker.model.decoder; bitwise the same
    # hidden states, without transformers' per-call wrappers). false = always the model's own forward.
    direct_forward: bool = True
    trust_remote_code: bool = False
    revision: Optional[str] = None
    seed: int = 0  # seed of tiny-random weights


@dataclass
class EngineConfig:
    # hybrid (the default): n-gram continuation + STAND store + ESP probe in one tree per row per pass
    method: str = "hybrid"  # ar | esp | pld | stand | lade | hybrid | cp_heads | dmtd | dmtd_verified
    # Tokens fed per decode pass per sequence: (k+1) * (1 + num draft nodes) for ESP. "auto" (the default;
    # esp, pld, hybrid, cp_heads): chosen per pass from a measured cost curve, the measured overhead of the
    # drafter and the rows' expected acceptance, plain decoding included.
    block_complexity: Union[int, str] = "auto"
    num_masks: int = 1  # k: mask tokens per input token (ESP)
    tree: str = "dynamic"  # static | dynamic
    # Static branch list [K_1..K_k]; empty = derived from block_complexity (see tree.static_branches).
    branches: list[int] = field(default_factory=list)
    expansion: str = "top1"  # dynamic trees: top1 (paper, Appendix D) | frontier (literal Algorithm 1)
    prune: bool = True  # replace a candidate equal to its parent's token by the next best
    mask_init: str = "mean"  # mean | last_k | sample | offset
    mask_init_last_k: int = 1  # last_k: mean of the last n prompt embeddings
    mask_init_offset: float = 5.0  # offset: mu + c * sigma of the embedding table
    ema_lambda: float = 0.1  # mask EMA toward each committed token's embedding; 0 freezes it
    probe_prefill: bool = True  # append the k masks to the prefill so the first decode pass has a tree
    # Prompt lookup (pld)
    pld_max_ngram: int = 3
    pld_min_ngram: int = 1
    pld_depth: int = 10
    # block_complexity=auto
    auto_max_block: int = 64  # largest block (tokens per sequence) the policy may choose
    auto_probe_interval: int = 8  # esp: after this many plain passes, one pass re-probes (root + masks)
    cost_curve_path: str = ""  # "" = measure at start and cache under $ESP_BATCH_CACHE (~/.cache/esp-batch)
    # torch.compile of the decoder layers' projections, norms, rotary and MLP (esp_worker/model/compiled.py); off:
    # on a CPU it runs slower than eager (docs/design/model-forward.md), on a GPU it is the place to start
    compile: bool = False
    compile_mode: str = ""  # torch.compile mode ("" = its default), e.g. max-autotune-no-cudagraphs
    # Decode passes replayed as CUDA graphs, one per shape class (batch bucket, block, capacity bucket): auto = on
    # for CUDA. true on a CPU runs the same static-buffer path eagerly (tests). esp_worker/graphs/
    cuda_graphs: Union[bool, str] = "auto"  # auto | true | false
    # key slots per row the graphs' KV slab holds (pinned at start-up); a row that needs more runs eagerly and
    # grows the slab, after which graphs are captured again over it (where the grown slab does not fit the device,
    # the batch's rows run eagerly in buffers of their own until they fit the slab again)
    cuda_graph_max_len: int = 2048
    # compile each graph's pass with Inductor (torch.compile, automatic dynamic shapes) before capturing it: fewer,
    # fused kernels in the replay, at a compile per new pass shape (tens of seconds on a GPU; start-up captures
    # nothing then, classes are compiled and captured as they come). esp_worker/graphs/step.py:compiled_step
    cuda_graphs_compile: bool = False
    # plain greedy or sampled passes (method ar) launched before the last one's host read, which the device then
    # copies behind it: the host's work between passes overlaps the device's. A pass found to have ended a row
    # makes the next one (run for it too, committing nothing there) be read at once. esp_worker/engine.py
    cuda_graphs_run_ahead: Union[bool, str] = "auto"  # auto = wherever passes are replayed | true | false
    # ESP's and the hybrid's probe (the mask EMA, the candidates, ESP's next static tree) and the hybrid's logit
    # store (the top K along the accepted path) as the last stage of a replayed pass, instead of on the host after
    # it: the same drafts, less host work between passes.
    # esp_worker/graphs/hooks.py, docs/design/cuda-graphs.md
    cuda_graphs_probe: bool = True
    # the SDPA kernel of decode passes' attention (the direct forward with sdpa attention; a prefill keeps torch's
    # choice): torch = PyTorch's own priority (cuDNN's on an H100/H200 in bfloat16, the fastest there at every
    # decode shape measured: docs/design/cuda-graphs.md), or cudnn | efficient | math (math where the one named
    # refuses the inputs), or flex: FlexAttention over a block mask of the rows' lengths in the compiled replayed
    # passes (needs cuda_graphs_compile; eager passes keep torch's choice; esp_worker/model/flex.py)
    attention_backend: str = "torch"
    # Batching
    # rows decoded together. The KV slab of engine.cuda_graphs and the auto policy's calibration are sized by it at
    # start-up: a size past the device's free memory is refused there as one line (esp_worker/memory.py)
    max_batch_size: int = 8
    prefill_batch_tokens: int = 8192  # cap on padded tokens per prefill forward
    # what one more prefill forward costs, in padded prompt tokens: admitted prompts are grouped into the chunks
    # that minimise forwards * this + padded tokens (esp_worker/prefill_plan.py). auto: measured at start-up on
    # CUDA (an eager forward is bound by its launches there: thousands of tokens for a 1B model), 16 on a CPU
    prefill_forward_tokens: Union[float, str] = "auto"
    # prompt prefixes that requests share (a system prompt, few-shot examples, a chat template's header) prefilled
    # once: their keys and values are kept, up to this many tokens, and copied into each prompt that starts with
    # one, whose prefill then feeds only the rest; 0 = off (esp_worker/prefix_cache.py)
    prefix_cache_tokens: int = 4096
    # when waiting requests join the batch as rows finish: auto = once the slots left idle have cost what a prefill
    # forward's fixed cost stalls the rows in flight (rent or buy; where that cost is measured: CUDA), eager = at
    # once (esp_worker/admission.py)
    admission: str = "auto"
    seed: int = 0  # base seed for requests that carry none
    # STAND (stand): logit store of the model's own past top-k, tree by cumulative probability (BC - 1 nodes)
    stand_max_ngram: int = 3  # suffix match lengths tried, longest first (as pld)
    stand_min_ngram: int = 1
    stand_depth: int = 10  # deepest draft node (the paper's depth 10)
    stand_topk: int = 8  # candidates kept per stored position (one chain token + stand_topk - 1 branches)
    # Lookahead decoding (lade): 0 = from block_complexity (paper Appendix F: BC 10 -> N=3,W=4,G=1;
    # 30 -> 4,5,5; 60 -> 5,8,7; other BCs see `lade_sizes` above)
    lade_ngram: int = 0  # N: n-gram size (N - 1 lookahead levels, drafts of N - 1 tokens)
    lade_window: int = 0  # W: lookahead window width
    lade_guess: int = 0  # G: n-grams verified per pass
    lade_pool_size: int = 1024  # n-grams remembered per sequence (least recently seen evicted first)
    # Trained rank-r CP multi-token heads (cp_heads): directory written by jobs.train_heads
    heads_path: str = ""
    # hybrid: n-gram continuation + STAND store (stand_* keys) + ESP probe (num_masks, mask_*) in one tree;
    # the root owns masks; trees of at least hybrid_mask_min_nodes draft nodes also give them to one node in
    # hybrid_mask_every (the likeliest ends of the accepted path)
    hybrid_mask_every: int = 4
    hybrid_mask_min_nodes: int = 32
    # hybrid: tokens of the job's finished requests (prompt + output) kept to draft from where a row's own
    # history has no n-gram match (the "corpus" proposer; stand_max_ngram .. stand_min_ngram); 0 = off
    hybrid_corpus_tokens: int = 262144
    # Direct multi-token decoding (docs/methods/dmtd.md). dmtd: the model is a DMTD model (esp-batch train-dmtd, or
    # the authors' checkpoint format); NOT lossless. dmtd_verified: dmtd_path holds a trained copy of the model's
    # last layers that drafts tau - 1 tokens per pass, verified by the model (lossless). block_complexity is
    # ignored by both: tau sets the block.
    dmtd_tau: int = 0  # tokens per cycle; 0 = the model's mtp_horizon (dmtd) or the copy's (dmtd_verified)
    dmtd_decoding_layers: int = 0  # dmtd: D; 0 = the model's; on a model without a split, an untrained one (speed only)
    dmtd_path: str = ""  # dmtd_verified: directory written by esp-batch train-dmtd dmtd.verified=true

    def lade_shape(self) -> tuple[int, int, int]:
        """lade's (N, W, G): the ones set, the others from the block complexity (`lade_sizes`)."""
        explicit = (self.lade_ngram, self.lade_window, self.lade_guess)
        n, w, g = explicit if all(explicit) else lade_sizes(self.block_complexity)
        return self.lade_ngram or n, self.lade_window or w, self.lade_guess or g

    def least_block(self) -> int:
        """The smallest block that holds a draft node: ESP feeds k masks after the root and after each node, the
        hybrid's masks follow the root only."""
        return {"esp": 2 * (self.num_masks + 1), "hybrid": self.num_masks + 2}.get(self.method, 2)

    @property
    def lossless(self) -> bool:
        """Whether the output is exactly the model's own decoding (every method but dmtd)."""
        return self.method not in NOT_LOSSLESS

    def validate(self) -> None:
        """Raise ValueError with a one-line, actionable message on a bad setting."""
        def bad(msg: str) -> None:
            raise ValueError(msg)

        pft = self.prefill_forward_tokens
        if pft != "auto" and (isinstance(pft, bool) or not isinstance(pft, (int, float)) or not 0 <= pft < 1e9):
            bad(f"engine.prefill_forward_tokens={pft!r} must be auto or a number of tokens >= 0")
        if isinstance(self.prefix_cache_tokens, bool) or not isinstance(self.prefix_cache_tokens, int) \
                or self.prefix_cache_tokens < 0:
            bad(f"engine.prefix_cache_tokens={self.prefix_cache_tokens!r} must be a number of tokens >= 0 (0: off)")
        if self.admission not in ("auto", "eager"):
            bad(f"engine.admission={self.admission!r} is unknown; choose auto or eager")
        if self.method not in METHODS:
            bad(f"engine.method={self.method!r} is unknown; choose one of {', '.join(METHODS)}")
        if self.tree not in TREES:
            bad(f"engine.tree={self.tree!r} is unknown; choose static or dynamic")
        if self.expansion not in EXPANSIONS:
            bad(f"engine.expansion={self.expansion!r} is unknown; choose top1 or frontier")
        if self.mask_init not in MASK_INITS:
            bad(f"engine.mask_init={self.mask_init!r} is unknown; choose one of {', '.join(MASK_INITS)}")
        if self.method in ("esp", "hybrid") and not 1 <= self.num_masks <= 8:
            bad(f"engine.num_masks={self.num_masks} must be between 1 and 8")
        if self.method in CYCLE_METHODS:
            if self.dmtd_tau < 0 or self.dmtd_decoding_layers < 0:
                bad("engine.dmtd_tau and engine.dmtd_decoding_layers must be >= 0 (0 = the model's)")
            if self.method == "dmtd_verified" and not self.dmtd_path:
                bad("engine.method=dmtd_verified needs engine.dmtd_path (a directory written by esp-batch train-dmtd "
                    "dmtd.verified=true)")
            if self.method == "dmtd_verified" and self.dmtd_tau == 1:
                bad("engine.dmtd_tau=1 drafts nothing; dmtd_verified needs tau >= 2")
            return self._validate_rest(bad)
        if self.block_complexity == "auto":
            if self.method not in ("ar", "esp", "pld", "hybrid", "cp_heads"):
                bad(f"engine.block_complexity=auto supports methods esp, pld, hybrid and cp_heads, not {self.method}; give a number")
            if self.auto_max_block < self.least_block():  # the largest block auto may choose must hold a draft node
                bad(f"engine.auto_max_block={self.auto_max_block} leaves no draft node for {self.method} with "
                    f"num_masks={self.num_masks}; use at least {self.least_block()}")
            return self._validate_rest(bad)
        if not isinstance(self.block_complexity, int) or isinstance(self.block_complexity, bool):
            bad(f"engine.block_complexity={self.block_complexity!r} must be an integer or auto")
        if self.method != "ar" and self.block_complexity < 2:
            bad(f"engine.block_complexity={self.block_complexity} must be >= 2 for speculative methods")
        if self.method in ("esp", "hybrid") and self.block_complexity < self.least_block():
            bad(f"engine.block_complexity={self.block_complexity} leaves no draft node for {self.method} with "
                f"num_masks={self.num_masks}; use at least {self.least_block()}")
        self._validate_rest(bad)

    def _validate_rest(self, bad) -> None:
        if self.method == "cp_heads" and not self.heads_path:
            bad("engine.method=cp_heads needs engine.heads_path (a directory written by jobs.train_heads)")
        if not 0.0 <= self.ema_lambda <= 1.0:
            bad(f"engine.ema_lambda={self.ema_lambda} must be in [0, 1]")
        if self.max_batch_size < 1:
            bad(f"engine.max_batch_size={self.max_batch_size} must be >= 1")
        if self.prefill_batch_tokens < 0:
            bad(f"engine.prefill_batch_tokens={self.prefill_batch_tokens} must be >= 0 (0: one prompt per forward)")
        if self.block_complexity == "auto" and self.auto_probe_interval < 1:
            bad(f"engine.auto_probe_interval={self.auto_probe_interval} must be >= 1 (plain passes between probes)")
        if not 1 <= self.pld_min_ngram <= self.pld_max_ngram:
            bad("engine.pld_min_ngram must be >= 1 and <= engine.pld_max_ngram")
        if self.pld_depth < 1:
            bad(f"engine.pld_depth={self.pld_depth} must be >= 1")
        if self.method in ("stand", "hybrid"):  # hybrid's store, chain and corpus take the stand_* keys
            if self.stand_topk < 1 or self.stand_depth < 1:
                bad("engine.stand_topk and engine.stand_depth must be >= 1")
            if not 1 <= self.stand_min_ngram <= self.stand_max_ngram:
                bad("engine.stand_min_ngram must be >= 1 and <= engine.stand_max_ngram")
            if self.method == "hybrid" and self.hybrid_corpus_tokens > 0 and self.stand_max_ngram > 64:
                bad(f"engine.stand_max_ngram={self.stand_max_ngram} must be <= 64 with the corpus on (hybrid looks up "
                    "the job's finished requests by n-grams of at most 64 tokens)")
        if self.method == "lade":
            try:
                n, w, g = self.lade_shape()
            except ValueError as exc:
                bad(str(exc))
            if n < 3 or w < 1 or g < 1:
                bad(f"lade needs engine.lade_ngram >= 3, engine.lade_window >= 1 and engine.lade_guess >= 1 (0 = from "
                    f"engine.block_complexity); got N={n} W={w} G={g}")
            if self.lade_pool_size < max(w, g):
                bad(f"engine.lade_pool_size={self.lade_pool_size} must be >= the window ({w}) and the n-grams "
                    f"verified per pass ({g})")
        if self.method == "esp" and self.tree == "static" and len(self.branches) > self.num_masks:
            bad(f"engine.branches={list(self.branches)} is deeper than engine.num_masks={self.num_masks}")
        if self.hybrid_mask_every < 1:
            bad(f"engine.hybrid_mask_every={self.hybrid_mask_every} must be >= 1")
        if self.hybrid_mask_min_nodes < 0:
            bad(f"engine.hybrid_mask_min_nodes={self.hybrid_mask_min_nodes} must be >= 0")
        if self.hybrid_corpus_tokens < 0:
            bad(f"engine.hybrid_corpus_tokens={self.hybrid_corpus_tokens} must be >= 0 (0 turns the corpus off)")
        if self.cuda_graphs not in ("auto", True, False):
            bad(f"engine.cuda_graphs={self.cuda_graphs!r} must be auto, true or false")
        if self.cuda_graphs_run_ahead not in ("auto", True, False):
            bad(f"engine.cuda_graphs_run_ahead={self.cuda_graphs_run_ahead!r} must be auto, true or false")
        if self.cuda_graphs_run_ahead is True and self.cuda_graphs is False:
            bad("engine.cuda_graphs_run_ahead=true runs replayed passes ahead of their reads; it needs "
                "engine.cuda_graphs=auto or true")
        if self.cuda_graphs_compile and self.cuda_graphs is False:
            bad("engine.cuda_graphs_compile=true compiles the replayed passes; it needs engine.cuda_graphs=auto "
                "or true")
        if self.cuda_graphs_compile and self.compile_mode in ("reduce-overhead", "max-autotune"):
            bad(f"engine.compile_mode={self.compile_mode} captures CUDA graphs of its own; with "
                "engine.cuda_graphs_compile use the default mode or max-autotune-no-cudagraphs")
        if self.attention_backend not in ATTENTION_BACKENDS:
            bad(f"engine.attention_backend={self.attention_backend!r} must be one of {', '.join(ATTENTION_BACKENDS)}")
        if self.attention_backend == "flex" and not self.cuda_graphs_compile:
            bad("engine.attention_backend=flex runs FlexAttention's compiled kernels in the replayed passes; it needs "
                "engine.cuda_graphs_compile=true")
        if self.cuda_graph_max_len < 1:
            bad(f"engine.cuda_graph_max_len={self.cuda_graph_max_len} must be >= 1")
        if any(b < 1 for b in self.branches):
            bad(f"engine.branches={list(self.branches)} must be positive integers")
