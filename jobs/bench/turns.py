"""Multi-turn rows in the benchmark: every turn runs, each later turn prompted with the setting's own earlier
answers (fed back per `data.turn_history`, as a job does), so a setting is timed on the whole conversation.

Turn k of every row of a category runs as one `generate` call after turn k - 1 of all of them: the settings see
the same prompts whenever their answers agree (lossless decoding: always, in float32).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Conversation:
    """A multi-turn row's turns and how a later turn's prompt is built."""

    turns: list[str]
    builder: Any  # jobs.run.prompts.PromptBuilder
    history: str = "stripped"  # data.turn_history: stripped | raw

    def ids(self, answers: list[str]) -> list[int]:
        """The prompt of turn len(answers): every earlier turn with its answer, then the turn."""
        messages: list[dict[str, str]] = []
        for question, answer in zip(self.turns, answers):
            fed = answer.strip() if self.history == "stripped" else answer
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": fed}]
        messages.append({"role": "user", "content": self.turns[len(answers)]})
        return self.builder.chat_ids(messages)


def joined(first: Any, later: Any) -> Any:
    """Two turns' RequestOutputs as one: tokens concatenated, statistics merged, the last turn's text and end."""
    return dataclasses.replace(later, token_ids=list(first.token_ids) + list(later.token_ids),
                               stats=first.stats.merge(later.stats))


def all_turns(prompts: list[Any], generate: Callable[[list[Any]], dict[str, Any]]) -> dict[str, Any]:
    """{id: RequestOutput over all of the row's turns} of bench Prompts (jobs/bench/settings.py).
    `generate(prompts)` runs one turn of the given prompts (their `ids`) and returns {id: RequestOutput}; a row
    whose turn fails stops there with that error."""
    outs = generate(prompts)
    answers = {p.id: [outs[p.id].text] for p in prompts if p.conversation is not None}
    turn = 1
    while True:
        pending = [p for p in prompts if p.id in answers and len(p.conversation.turns) > turn
                   and outs[p.id].error is None]
        if not pending:
            return outs
        got = generate([dataclasses.replace(p, ids=p.conversation.ids(answers[p.id])) for p in pending])
        for p in pending:
            answers[p.id].append(got[p.id].text)
            outs[p.id] = joined(outs[p.id], got[p.id])
        turn += 1
