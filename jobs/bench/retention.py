"""Quality retention of a method whose output is not the model's own (dmtd), measured against the bench's model's
greedy output (the `ar` run of the same bench): what we can measure without task scores.

- token agreement: tokens equal to ar's at the same position / ar's tokens;
- first divergence: the position of the first token that differs from ar's (the shorter length when one output
  is a prefix of the other), averaged over prompts;
- base NLL: the bench's model's mean negative log-likelihood (nats per token) of the method's output, beside that
  of its own greedy output (`base_nll_ar`): how much less likely the base model finds the method's text.
"""
from __future__ import annotations

from typing import Any, Optional

from .settings import ALL, Prompt


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where a and b differ (min length when one is a prefix of the other).

    Example: [1, 2, 3], [1, 2, 4, 5] -> 2; [1, 2], [1, 2, 3] -> 2."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def base_nll(loaded: Any, prompt_ids: list[int], output_ids: list[int]) -> tuple[float, int]:
    """(sum of -log p(token) under the bench's model over `output_ids` after the prompt, number of tokens)."""
    import torch

    if not output_ids:
        return 0.0, 0
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=loaded.device)
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()  # [N, V]
        nll = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt_ids):], reduction="sum")
    return float(nll), len(output_ids)


def retention(loaded: Any, prompts: list[Prompt], outputs: dict[str, Any], reference: dict[str, Any]) -> dict[str, Optional[float]]:
    """The retention fields of one group of prompts: outputs and reference map prompt id -> RequestOutput."""
    agree = total = 0
    firsts = []
    nll = [0.0, 0]
    nll_ref = [0.0, 0]
    for p in prompts:
        a, r = outputs[p.id].token_ids, reference[p.id].token_ids
        agree += sum(x == y for x, y in zip(a, r))
        total += len(r)
        firsts.append(first_divergence(a, r))
        for acc, toks in ((nll, a), (nll_ref, r)):
            s, n = base_nll(loaded, p.ids, toks)
            acc[0] += s
            acc[1] += n
    return dict(token_agreement=agree / total if total else None,
                first_divergence=sum(firsts) / len(firsts) if firsts else None,
                base_nll=nll[0] / nll[1] if nll[1] else None, base_nll_ar=nll_ref[0] / nll_ref[1] if nll_ref[1] else None)


def add_retention(records: list[dict[str, Any]], loaded: Any, prompts: list[Prompt], outputs: dict[str, Any],
                  reference: dict[str, Any]) -> None:
    """Each record (one per category, and ALL) gets the retention fields of its prompts, in place."""
    for rec in records:
        group = [p for p in prompts if rec["category"] in (ALL, p.category)]
        rec.update(retention(loaded, group, outputs, reference))
