"""The output Parquet schema and building a part's Arrow table from per-row records."""
from __future__ import annotations

from typing import Any, Optional

import pyarrow as pa

from esp_worker.config import METHODS

# One answer of a row that asks for generation.n > 1 samples: what the row's own columns say of its first sample.
SAMPLE = pa.struct([
    ("text", pa.string()),
    ("turns", pa.list_(pa.string())),
    ("token_ids", pa.list_(pa.int32())),
    ("token_logprobs", pa.list_(pa.float32())),
    ("finish_reason", pa.string()),
    ("num_generated_tokens", pa.int64()),
    ("num_decode_passes", pa.int64()),
    ("num_decode_tokens", pa.int64()),
    ("tau", pa.float64()),
    ("time_s", pa.float64()),
    ("error", pa.string()),
    ("turn_generated_tokens", pa.list_(pa.int64())),
    ("turn_time_s", pa.list_(pa.float64())),
    ("turn_decode_passes", pa.list_(pa.int64())),
    ("committed_per_pass", pa.list_(pa.int32())),
])

# Required columns, in file order. Counters of a multi-turn row are sums over its turns, and those of a row with
# several samples sums over every sample's; the answer columns are its first sample's.
BASE_FIELDS = [
    pa.field("id", pa.string(), nullable=False),
    pa.field("generated_text", pa.string()),  # turns input: the last answer
    pa.field("generated_turns", pa.list_(pa.string())),  # turns input: every answer; null otherwise
    pa.field("samples", pa.list_(SAMPLE)),  # generation.n > 1: every sample's answer and counters; null otherwise
    pa.field("generated_token_ids", pa.list_(pa.int32())),  # turns input: all answers' tokens, concatenated
    pa.field("token_logprobs", pa.list_(pa.float32())),  # generation.logprobs: one per generated token; else null
    # generation.top_logprobs: per generated token, the likeliest tokens there, best first; else null
    pa.field("top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))),
    # generation.prompt_logprobs: the (last turn's) prompt as the model read it, and each token's log-probability
    pa.field("prompt_token_ids", pa.list_(pa.int32())),
    pa.field("prompt_logprobs", pa.list_(pa.float32())),
    pa.field("num_prompt_tokens", pa.int64()),
    pa.field("num_cached_prompt_tokens", pa.int64()),  # of them, copied from a shared prefix (prefix cache)
    pa.field("num_generated_tokens", pa.int64()),
    pa.field("finish_reason", pa.string()),  # stop | length | context; null on error
    pa.field("method", pa.string()),
    pa.field("lossless", pa.bool_()),  # false: the method's output is not the model's own decoding (dmtd)
    pa.field("num_decode_passes", pa.int64()),
    pa.field("num_decode_tokens", pa.int64()),  # tokens committed by decode passes (tau's numerator)
    pa.field("num_drafted_tokens", pa.int64()),
    pa.field("num_accepted_drafts", pa.int64()),
    pa.field("accepted_per_depth", pa.list_(pa.int32())),  # [depth] passes whose accepted path reached depth+1
    pa.field("committed_histogram", pa.list_(pa.int32())),  # [n] decode passes that committed n tokens
    pa.field("accepted_by_proposer", pa.map_(pa.string(), pa.int64())),  # hybrid: accepted drafts per proposer
    pa.field("tau", pa.float64()),  # mean tokens committed per decode pass; null without decode passes
    pa.field("plt", pa.float64()),  # dmtd: layers per token / the model's layers; null for other methods
    pa.field("time_s", pa.float64()),  # seconds from the request's admission to its finish; null if none ran
    pa.field("error", pa.string()),  # null when fine
    # one entry per answered turn (prompt and messages rows: one); the counters above are their sums
    pa.field("turn_generated_tokens", pa.list_(pa.int64())),
    pa.field("turn_time_s", pa.list_(pa.float64())),
    pa.field("turn_decode_passes", pa.list_(pa.int64())),
    pa.field("committed_per_pass", pa.list_(pa.int32())),  # [pass] tokens it committed, in order, over all turns
    # vLLM's per-request spec-decode metrics, under vLLM's names (docs/guide/outputs.md)
    pa.field("num_drafts", pa.int64()),
    pa.field("num_draft_tokens", pa.int64()),
    pa.field("num_accepted_tokens", pa.int64()),
    pa.field("num_accepted_tokens_per_pos", pa.list_(pa.int32())),
]
CATEGORY = "category"

# A short description of each column, stored in the Parquet schema (field metadata key b"description")
# so that a reader of the files alone can tell what each column means.
DESCRIPTIONS = {
    "id": "row id from the input's id column (as a string), or row-<position>-<hash of input> when absent",
    "generated_text": "the generated answer; for a multi-turn (turns) input, the last turn's answer",
    "generated_turns": "multi-turn input: every turn's answer in order; null otherwise",
    "samples": "generation.n > 1: each sample's answer (text, turns, token_ids, token_logprobs with generation.logprobs, "
               "finish_reason, error) and counters, sample 0 first; the row's answer columns are sample 0's, its "
               "counters sums over every sample; null when n = 1",
    "generated_token_ids": "token ids of the generated text (all turns concatenated)",
    "token_logprobs": "generation.logprobs: each generated token's log-probability under the model (float32 "
                      "log-softmax of its raw logits: temperature 1, before top-p/top-k), aligned with "
                      "generated_token_ids; null otherwise",
    "top_logprobs": "generation.top_logprobs: per generated token, the top_logprobs likeliest tokens where it was "
                    "chosen (token_id, logprob), best first; null otherwise",
    "prompt_token_ids": "generation.prompt_logprobs: the prompt's tokens after the chat template (for turns input, "
                        "the last answered turn's prompt); null otherwise",
    "prompt_logprobs": "generation.prompt_logprobs: each prompt token's log-probability given the tokens before it, "
                       "aligned with prompt_token_ids (null for the first); null otherwise",
    "num_prompt_tokens": "tokens in the prompt after the chat template (summed over turns and samples)",
    "num_cached_prompt_tokens": "of num_prompt_tokens, those whose keys and values were copied from a prefix the "
                                "prompt shares with others (engine.prefix_cache_tokens), not fed to the model",
    "num_generated_tokens": "tokens generated (summed over turns and samples)",
    "finish_reason": "stop (EOS or stop string) | length (max_new_tokens) | context (model context full); null on error",
    "method": "decoding method: " + " | ".join(METHODS),
    "lossless": "true when the text is exactly the model's own decoding (every method but dmtd, which decodes with "
                "a different, fine-tuned model's layer cycles)",
    "num_decode_passes": "model forward passes after the prefill",
    "num_decode_tokens": "tokens committed by decode passes (bonus included, prefill's first token not): tau's numerator",
    "num_drafted_tokens": "draft tokens fed to the model for verification",
    "num_accepted_drafts": "draft tokens accepted by verification",
    "accepted_per_depth": "[d] = decode passes whose accepted draft path reached depth d+1",
    "committed_histogram": "[n] = decode passes that committed n tokens",
    "accepted_by_proposer": "hybrid: accepted draft tokens per proposer (ngram, store, esp, corpus, and heads with engine.heads_path); empty for other methods",
    "tau": "mean acceptance length: num_decode_tokens / num_decode_passes; null without decode passes",
    "plt": "dmtd: layers run per generated token / the model's layers over the decode passes (the DMTD paper's PLT); "
           "null for other methods",
    "time_s": "seconds from the request's admission to its finish, summed over turns and samples (rows share the "
              "engine's batches); null when no turn was generated",
    "error": "one-line error message (with generation.n > 1: the first failing sample's); null when the row was "
             "generated",
    "turn_generated_tokens": "tokens generated per answered turn, in order (one entry for prompt and messages rows; "
                             "sample 0's with generation.n > 1)",
    "turn_time_s": "seconds per answered turn, from its admission to its finish",
    "turn_decode_passes": "decode passes per answered turn",
    "committed_per_pass": "tokens each decode pass committed, in order over all turns and samples (Spec-Bench's "
                          "accept_lengths; sum = num_decode_tokens, length = num_decode_passes)",
    "num_drafts": "vLLM num_drafts: decode passes that fed this row at least one draft token",
    "num_draft_tokens": "vLLM num_draft_tokens: draft tokens fed for verification (= num_drafted_tokens)",
    "num_accepted_tokens": "vLLM num_accepted_tokens: draft tokens accepted and kept (= num_accepted_drafts)",
    "num_accepted_tokens_per_pos": "vLLM num_accepted_tokens_per_pos: [i] = passes whose accepted draft reached "
                                   "position i+1 (= accepted_per_depth)",
    CATEGORY: "the input's category column (data.category_column), used for per-category statistics",
}
DESCRIPTION_KEY = b"description"


def carry_types(names: list[str], schema: Optional[pa.Schema], sample: list[dict[str, Any]]) -> dict[str, pa.DataType]:
    """Arrow type of each carried column: from the input schema when it has one, else inferred from
    `sample` rows (string when every sampled value is null or the values do not share a type)."""
    types: dict[str, pa.DataType] = {}
    for name in names:
        if schema is not None and name in schema.names:
            types[name] = schema.field(name).type
            continue
        try:
            inferred = pa.array([row.get(name) for row in sample]).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            inferred = pa.string()
        types[name] = pa.string() if pa.types.is_null(inferred) else inferred
    return types


def describe(schema: pa.Schema, carried: Optional[list[str]] = None) -> pa.Schema:
    """`schema` with a short description of each column in its field metadata (b"description"); carried
    input columns (any column not in DESCRIPTIONS, or those named in `carried`) say so. Other metadata is kept.

    >>> describe(pa.schema([pa.field("tau", pa.float64())])).field("tau").metadata[b"description"][:24]
    b'mean acceptance length: '
    """
    fields = []
    for f in schema:
        text = DESCRIPTIONS.get(f.name) if f.name not in (carried or []) else None
        text = text or f"copied from the input column {f.name!r} (data.carry_columns)"
        fields.append(f.with_metadata({**(f.metadata or {}), DESCRIPTION_KEY: text.encode()}))
    return pa.schema(fields, metadata=schema.metadata)


def descriptions(schema: pa.Schema) -> dict[str, str]:
    """{column: description} read back from a schema (e.g. `pq.read_schema(part)`); "" where none."""
    return {f.name: (f.metadata or {}).get(DESCRIPTION_KEY, b"").decode() for f in schema}


def output_schema(has_category: bool, carry: dict[str, pa.DataType]) -> pa.Schema:
    """The output schema, every column described (see `describe`)."""
    extra = [pa.field(CATEGORY, pa.string())] if has_category else []
    extra += [pa.field(name, typ) for name, typ in carry.items() if name not in (CATEGORY, *(f.name for f in BASE_FIELDS))]
    return describe(pa.schema(BASE_FIELDS + extra), carried=[n for n in carry if n != CATEGORY])


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
    """Values as `typ`; a value that does not convert (wrong type, invalid UTF-8) becomes null."""
    try:
        return pa.array(values, type=typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
        out = []
        for v in values:
            try:
                pa.array([v], type=typ)
                out.append(v)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
                out.append(None)
        return pa.array(out, type=typ)


def to_table(records: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """Records (dicts keyed by column name; missing keys are null) as a table with exactly `schema`."""
    columns = [_column([r.get(f.name) for r in records], f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)
