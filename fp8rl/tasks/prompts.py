"""From an example to the token ids the model continues: chat templates, system prompts, tokenizer quirks.

``task.chat_template``:
- ``auto`` (default): the tokenizer's chat template when it has one (instruct models), with the
  generation prompt appended, else the raw prompt (the tiny char model has none: unchanged);
- ``always``: the chat template, and an error if the tokenizer has none;
- ``never``: the raw prompt text, tokenized as it is.

``task.system_prompt`` becomes a ``system`` turn under a template, or a prefix line (``system\\n\\nprompt``)
without one.  A record's ``messages`` need a template.  A BOS token the template already wrote and the
tokenizer adds again is dropped (some templates start with ``<s>``/``<|begin_of_text|>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fp8rl.errors import UserError
from fp8rl.tasks.verify import Example

ChatTemplateMode = Literal["auto", "always", "never"]


class PromptError(UserError):
    """An example cannot be rendered for this tokenizer (no chat template for ``always`` or for messages)."""


@dataclass(frozen=True)
class PromptFormat:
    chat_template: ChatTemplateMode = "auto"
    system_prompt: str | None = None

    def uses_template(self, tokenizer: Any) -> bool:
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.chat_template == "always" and not has:
            raise PromptError("task.chat_template is 'always', but the tokenizer has no chat template")
        return has and self.chat_template != "never"

    def messages(self, example: Example) -> list[dict[str, str]]:
        turns = example.messages or (("user", example.prompt),)
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": role, "content": content} for role, content in turns]

    def text(self, example: Example) -> str:
        """The raw prompt text (no template)."""
        if example.messages:
            raise PromptError(
                "a record with 'messages' needs a chat template (the tokenizer has none, or task.chat_template is "
                "'never'); give 'prompt' text instead"
            )
        return f"{self.system_prompt}\n\n{example.prompt}" if self.system_prompt else example.prompt

    def encode(self, tokenizer: Any, example: Example) -> list[int]:
        """Token ids of ``example``'s prompt for ``tokenizer`` (module docstring)."""
        if self.uses_template(tokenizer):
            out = tokenizer.apply_chat_template(self.messages(example), add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        else:
            ids = list(tokenizer(self.text(example)).input_ids)
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return [int(i) for i in ids]

    def encode_all(self, tokenizer: Any, examples: list[Example]) -> list[list[int]]:
        return [self.encode(tokenizer, e) for e in examples]
