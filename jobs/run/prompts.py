"""Turn a row's conversation into prompt token ids, with the tokenizer's chat template or without one.

Without a chat template:
- a `prompt` string is tokenized exactly as `tokenizer(prompt)` does (outputs can be checked against
  `model.generate` on the same text);
- chat messages and multi-turn conversations use this plain-text format, one line per message, ending
  with the cue for the next answer:

      System: <system content>
      User: <turn 1>
      Assistant: <answer 1>
      User: <turn 2>
      Assistant:

  (role names: system -> System, user -> User, assistant -> Assistant, others capitalised), then
  tokenized as `tokenizer(text)`.
With a chat template, a prompt string is sent as one user message, and the template is rendered with
`add_generation_prompt=True` and tokenized without adding special tokens again.
"""
from __future__ import annotations

from typing import Any

Message = dict[str, str]
_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_plain(messages: list[Message]) -> str:
    """The plain-text multi-turn format above.

    >>> render_plain([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
    ...               {"role": "user", "content": "Bye"}])
    'User: Hi\\nAssistant: Hello\\nUser: Bye\\nAssistant:'
    """
    lines = [f"{_ROLE_NAMES.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


class PromptBuilder:
    """Token ids for a prompt string or a list of chat messages, per `data.chat_template`."""

    def __init__(self, tokenizer: Any, mode: str, template_kwargs: dict[str, Any]):
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if mode == "always" and not has_template:
            raise ValueError("data.chat_template=always but the tokenizer has no chat template; use auto or never")
        self.tokenizer = tokenizer
        self.use_template = has_template and mode != "never"
        self.template_kwargs = dict(template_kwargs)

    def prompt_ids(self, prompt: str) -> list[int]:
        if self.use_template:
            return self.chat_ids([{"role": "user", "content": prompt}])
        return list(self.tokenizer(prompt).input_ids)

    def chat_ids(self, messages: list[Message]) -> list[int]:
        if not self.use_template:
            return list(self.tokenizer(render_plain(messages)).input_ids)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
