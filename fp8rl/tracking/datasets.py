"""The data a run trained and was evaluated on, as MLflow dataset inputs (the run's "Datasets used").

One record per split: a name, a digest of its examples (two runs with the same digest saw the same
problems in the same order), where it came from (a file's path, or the built-in task and its
settings) and its size.  Nothing here imports mlflow; ``MlflowSink.log_datasets`` logs the records.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fp8rl.tasks import Example

Context = Literal["training", "evaluation"]
DIGEST_CHARS = 16


@dataclass(frozen=True)
class DatasetRecord:
    name: str
    context: Context  # MLflow's ``mlflow.data.context`` input tag
    digest: str
    source_type: Literal["local", "code"]  # a file, or examples the code generates from settings
    source: dict[str, Any]  # ``{"uri": path}`` for a file; ``{"tags": settings}`` for a built-in task
    rows: int

    def profile(self) -> str:
        return json.dumps({"num_rows": self.rows})


def examples_digest(examples: Sequence[Example]) -> str:
    """A digest of the examples' prompts, conversations and answers, in order."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.prompt, e.answer, e.messages], default=list).encode())
        h.update(b"\n")
    return h.hexdigest()[:DIGEST_CHARS]


def file_dataset(path: str | Path, context: Context, examples: Sequence[Example]) -> DatasetRecord:
    p = Path(path).resolve()
    return DatasetRecord(p.name, context, examples_digest(examples), "local", {"uri": str(p)}, len(examples))


def builtin_dataset(
    task: str, split: str, context: Context, settings: dict[str, Any], examples: Sequence[Example]
) -> DatasetRecord:
    tags = {"fp8rl.task": task, "split": split, **{k: str(v) for k, v in settings.items()}}
    return DatasetRecord(f"{task}-{split}", context, examples_digest(examples), "code", {"tags": tags}, len(examples))
