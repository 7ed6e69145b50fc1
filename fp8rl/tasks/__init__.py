"""Verifiable tasks: problems with exact answers, and the reward that checks a response against one.

- ``verify``: ``Example`` (prompt, normalised answer), ``extract_answer`` (``#### 42``,
  ``\\boxed{42}`` or a bare number), ``normalize_answer`` and ``exact_match_reward``.
- ``arithmetic``: ``ArithmeticTask``, deterministic synthetic integer arithmetic
  (``"12+7="`` -> ``"19"``) with disjoint train and test splits.
- ``word_problems``: ``WordProblemTask``, seeded multi-step arithmetic word problems with a difficulty level
  (a held-out task for real pretrained models).
- ``jsonl``: ``load_examples`` (JSON Lines or Parquet, a field map, chat ``messages``), ``load_jsonl`` /
  ``write_jsonl`` for users' own data, with ``DatasetError`` naming the file and line at fault.
- ``prompts``: ``PromptFormat`` (chat templates, system prompt, doubled BOS) -> prompt token ids.
- ``rewards``: exact match with ``strict | last-number | boxed | gsm8k`` extraction, or a user's Python
  reward function run with a timeout.

Nothing here imports torch: configs and pipelines can load tasks cheaply.
"""

from fp8rl.tasks.arithmetic import ArithmeticTask
from fp8rl.tasks.jsonl import DatasetError, load_examples, load_jsonl, write_jsonl
from fp8rl.tasks.verify import Example, exact_match_reward, extract_answer, normalize_answer
from fp8rl.tasks.word_problems import WordProblemTask

__all__ = [
    "ArithmeticTask",
    "DatasetError",
    "Example",
    "WordProblemTask",
    "exact_match_reward",
    "extract_answer",
    "load_examples",
    "load_jsonl",
    "normalize_answer",
    "write_jsonl",
]
