"""Colocated rollout workers report the device memory their engines freed by sleeping.

The measurement itself (``torch.cuda.mem_get_info`` around vLLM's sleep) needs a GPU and vLLM; it ran on the
H100 (docs/benchmarks.md). Here the workers are stand-ins at that boundary that return what a vLLM worker
returns (bytes) or what a torch-engine worker returns (None), and the group's aggregation is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fp8rl.cluster.groups import RolloutGroup


@dataclass
class _Remote:
    value: Any

    def remote(self) -> Any:
        return self.value


class _Worker:
    def __init__(self, freed: int | None) -> None:
        self.sleep = _Remote(freed)


class _Calls:
    def get(self, refs: Any, what: Any) -> Any:
        return refs


def test_the_group_sums_what_its_engines_freed() -> None:
    group = RolloutGroup([_Worker(3 << 30), _Worker(1 << 30)], _Calls(), True, 0)  # type: ignore[arg-type]
    group.sleep()
    assert group.sleep_freed_bytes == 4 << 30


def test_engines_that_do_not_measure_report_nothing_and_split_layouts_never_sleep() -> None:
    group = RolloutGroup([_Worker(None)], _Calls(), True, 0)  # type: ignore[arg-type]
    group.sleep()
    assert group.sleep_freed_bytes is None
    split = RolloutGroup([_Worker(1)], _Calls(), False, 0)  # type: ignore[arg-type]
    split.sleep()
    assert split.sleep_freed_bytes is None
