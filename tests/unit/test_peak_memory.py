"""The peak-memory sampler of the Ray actors' GPUs (``fp8rl.cluster.memory``) and how the step benchmark
reports it, against a reader whose readings the test controls (the NVML reader needs a GPU)."""

from __future__ import annotations

import threading
import time

import pytest

from fp8rl.bench.step import report
from fp8rl.bench.throughput import ThroughputResult
from fp8rl.cluster.memory import PeakMemorySampler, merge_peaks
from fp8rl.config import RayConfig


class Reader:
    """Bytes in use, changed by the test; counts the reads so the test can wait for the thread's next ones."""

    def __init__(self, value: int) -> None:
        self.value, self.reads, self.fail = value, 0, False
        self.lock = threading.Lock()

    def __call__(self) -> int:
        with self.lock:
            self.reads += 1
            if self.fail:
                raise OSError("NVML went away")
            return self.value

    def wait_reads(self, n: int) -> None:
        start = self.reads
        deadline = time.monotonic() + 5
        while self.reads < start + n:
            assert time.monotonic() < deadline, "the sampler thread stopped reading"
            time.sleep(0.001)


def test_sampler_keeps_a_peak_that_came_and_went_between_calls() -> None:
    read = Reader(100)
    sampler = PeakMemorySampler(read, interval_s=0.001)
    try:
        read.value = 900  # a transient the caller never reads itself
        read.wait_reads(3)
        read.value = 200
        read.wait_reads(3)
        assert sampler.peak() == 900
        assert sampler.peak(reset=True) == 900  # the window's peak, then a new window from now
        read.wait_reads(3)
        assert sampler.peak() == 200
    finally:
        sampler.close()


def test_sampler_that_stopped_raises_instead_of_reporting_an_idle_gpu() -> None:
    read = Reader(100)
    sampler = PeakMemorySampler(read, interval_s=0.001)
    try:
        read.fail = True
        deadline = time.monotonic() + 5
        while sampler._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        read.fail = False
        with pytest.raises(RuntimeError, match="sampler stopped: OSError"):
            sampler.peak()
    finally:
        sampler.close()
    with pytest.raises(ValueError, match="interval_s"):
        PeakMemorySampler(read, interval_s=0)


def test_actors_sharing_a_gpu_count_it_once_and_cpu_actors_not_at_all() -> None:
    names = ["trainer-0", "trainer-1", "rollout-0", "rollout-1"]
    got = merge_peaks([{"GPU-a": 10}, {"GPU-b": 5}, {"GPU-a": 30}, {"GPU-b": 7}], names)
    assert got == {"trainer-0+rollout-0": 30, "trainer-1+rollout-1": 7}
    assert merge_peaks([{"GPU-a": 3}, None], ["trainer-0", "rollout-0"]) == {"trainer-0": 3}
    assert merge_peaks([None, None], ["trainer-0", "rollout-0"]) == {}


def test_step_report_shows_each_gpus_peak_on_several_gpus() -> None:
    two = ThroughputResult("bf16", "cuda", "GPU", 2, 1, 10.0, 10.0, 0.5, 1.0, 2.0, 8.0, peak_gpu_used_gb=70.5,
                           peak_gpu_used_gb_per_gpu={"trainer-0": 40.25, "rollout-0": 70.5})  # fmt: skip
    one = ThroughputResult("fp8-e2e", "cuda", "GPU", 2, 1, 10.0, 10.0, 0.5, 1.0, 2.0, 8.0, peak_gpu_used_gb=30.0,
                           peak_gpu_used_gb_per_gpu={"trainer-0+rollout-0": 30.0})  # fmt: skip
    ray = RayConfig(layout="split", sync="collective").model_dump(mode="json")  # as run_metadata writes it
    doc, md = report([two, one], {"model": "llama-3b", "device_name": "GPU", "gpus": 2, "ray": ray})
    assert md.startswith("RL step benchmark: llama-3b on 2x GPU, Ray split layout, 1 trainer (replicate) + 1 rollout "
                         "worker(s), sync collective,")  # fmt: skip
    rows = [line for line in md.splitlines() if line.startswith("| bf16") or line.startswith("| fp8-e2e")]
    assert rows[0].endswith("| trainer-0 40.2, rollout-0 70.5 |") and rows[1].endswith("| 30.0 |")
    assert doc["results"][0]["peak_gpu_used_gb_per_gpu"] == {"trainer-0": 40.25, "rollout-0": 70.5}

    assert two.metrics()["bench/peak_gpu_used_gb/rollout-0"] == 70.5 and two.metrics()["bench/peak_gpu_used_gb"] == 70.5
    assert one.metrics()["bench/peak_gpu_used_gb/trainer-0_rollout-0"] == 30.0  # MLflow-safe: no '+'
