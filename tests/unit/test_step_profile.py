"""``fp8rl.train.step_profile``: a policy step's kernel time by category, on request (``bench step --profile-train``).

On the CPU the categories come from the aten ops' own CPU time (the GPU's kernel names are checked by name here,
and the GPU's profile by ``experiments/gpu_fp8_speed.py``'s rlprofile section): an armed step reports them, the steps
before and after do not, the step itself is the same step, and a Ray trainer group reports the busiest rank's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl.cluster.groups import combine_rank_metrics
from fp8rl.config import GRPOConfig, OptimConfig
from fp8rl.train.old_logprobs import PolicyStep, RecomputedOld
from fp8rl.train.step_profile import CALLS_PREFIX, METRIC_PREFIX, WALL_KEY, category
from fp8rl.train.trainer import TorchTrainer, TrainerOptions, build_batch


@pytest.mark.parametrize(
    ("kernel", "expected"),
    [
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm"),
        ("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128", "attention"),
        ("_groups_kernel", "fp8_quantize"),
        ("void transformer_engine::detail::cast_transpose_general_kernel<128u, float, __nv_bfloat16>", "fp8_quantize"),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>", "other"),
        ("aten::mm", "gemm"),
        ("aten::mul", "other"),
    ],
)
def test_kernels_fall_in_their_categories(kernel: str, expected: str) -> None:
    assert category(kernel) == expected


def _batch() -> tuple:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 20, (4,), generator=g).tolist() for _ in range(4)]
    responses = torch.randint(3, 20, (4, 6), generator=g)
    mask = torch.ones(4, 6)
    return build_batch(prompts, responses, mask, pad_id=0), torch.randn(4, generator=g), -torch.rand(4, 6), mask


def test_an_armed_policy_step_reports_its_kernel_time_and_is_the_same_step(tiny_models: dict[str, Path]) -> None:
    batch, adv, old, mask = _batch()
    runs = []
    for profiled in (False, True):
        trainer = TorchTrainer(
            tiny_models["tiny"], TrainerOptions(optim=OptimConfig(lr=1e-3, micro_batch_size=2, warmup_steps=0))
        )
        steps = []
        for i in range(3):
            if profiled and i == 1:
                trainer.profile_next_policy_step()
            steps.append(trainer.policy_step(PolicyStep(batch, adv, RecomputedOld(old, None, mask), GRPOConfig(), 1.0)))
        runs.append(steps)
    plain, profiled_run = runs
    first, armed, after = profiled_run
    times = {k.removeprefix(METRIC_PREFIX): v for k, v in armed.items() if k.startswith(METRIC_PREFIX)}
    assert times["gemm"] > 0 and times["other"] > 0 and times["optimizer"] >= 0
    calls = {k.removeprefix(CALLS_PREFIX): v for k, v in armed.items() if k.startswith(CALLS_PREFIX)}
    assert set(calls) == set(times) and all(n >= 1 and n == int(n) for n in calls.values())
    # two micro-batches, forward and backward through every linear of the tiny model: many GEMMs, not one
    assert calls["gemm"] >= 2 * 2 * 7
    assert not any(k.startswith(METRIC_PREFIX) for m in (first, after) for k in m)
    assert armed[WALL_KEY] > 0
    for a, b in zip(plain, profiled_run, strict=True):  # the profiler watched; it changed nothing
        b = {k: v for k, v in b.items() if not k.startswith("profile/")}
        assert a == b


def test_a_trainer_group_reports_the_profile_of_its_busiest_rank_whole() -> None:
    """The rank with the most non-NCCL kernel time gives every profile number (NCCL's largest is the rank that
    waited longest); the other metrics are combined as before, whichever ranks have them."""
    p = METRIC_PREFIX
    ranks = [
        {"loss": 0.5, "grad_norm": 2.0, "lr": 1e-3, p + "gemm": 10.0, p + "other": 5.0, p + "nccl": 9.0, WALL_KEY: 1.0},
        {"loss": 0.25, "grad_norm": 2.0, "lr": 1e-3, "clip_frac": 0.5, p + "gemm": 12.0, p + "nccl": 1.0,
         WALL_KEY: 1.1},
    ]  # fmt: skip
    assert combine_rank_metrics(ranks) == {
        "loss": 0.75, "grad_norm": 2.0, "lr": 1e-3, "clip_frac": 0.5, p + "gemm": 10.0, p + "other": 5.0,
        p + "nccl": 9.0, WALL_KEY: 1.0,
    }  # fmt: skip


def test_quantization_kernels_pair_with_their_launches_only_when_names_and_counts_agree() -> None:
    """``quantize_ms_by_launch`` on kernel events as the profiler lists them (name, device type, time range; built
    here: the pairing is pure bookkeeping, the GPU test pairs a real profile): in start order, by kernel name."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from fp8rl.train.step_profile import QUANT_CALLS_PREFIX, QUANT_MS_PREFIX, QUANT_UNPAIRED, quantize_ms_by_launch

    def event(name: str, start: int, us: int, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
        span = SimpleNamespace(start=start, elapsed_us=lambda: us)
        return SimpleNamespace(name=name, device_type=device, time_range=span)

    events = [event("_groups_kernel", 30, 400), event("_groups_kernel", 10, 100), event("_tiles_kernel", 50, 50),
              event("nvjet_sm90_gemm", 20, 999), event("_groups_kernel", 40, 7, DeviceType.CPU)]  # fmt: skip
    prof = SimpleNamespace(events=lambda: events)
    launches = [("_groups_kernel", "1x128/256x512/rowwise"), ("_groups_kernel", "1x128/256x512/transposed"),
                ("_tiles_kernel", "128x128/256x512/tiles")]  # fmt: skip
    out = quantize_ms_by_launch(prof, launches)
    assert out[QUANT_MS_PREFIX + "1x128/256x512/rowwise"] == 0.1  # the earliest event is the first launch
    assert out[QUANT_MS_PREFIX + "1x128/256x512/transposed"] == 0.4
    assert out[QUANT_CALLS_PREFIX + "128x128/256x512/tiles"] == 1 and QUANT_UNPAIRED not in out
    assert quantize_ms_by_launch(prof, launches[:2]) == {QUANT_UNPAIRED: 1.0}  # a kernel more than launches
    swapped = [launches[0], launches[2], launches[1]]  # same count, a name that does not match its event
    assert quantize_ms_by_launch(prof, swapped) == {QUANT_UNPAIRED: 1.0}


def test_stream_gaps_are_summed_by_size_and_the_long_ones_by_the_kernel_after_them() -> None:
    from fp8rl.train.step_profile import (
        GAP_BEFORE_KERNEL_PREFIX,
        GAP_BEFORE_PREFIX,
        GAP_DURING_COLLECTIVE,
        GAP_MS_PREFIX,
        GAPS_PREFIX,
        stream_gaps,
    )

    kernels = [  # (start us, end us, name), out of order; two kernels overlap (kineto's timestamps may)
        (3_000.0, 3_500.0, "nvjet_gemm"),
        (0.0, 1_000.0, "embedding_kernel"),
        (1_005.0, 1_050.0, "elementwise"),  # 5 us after the first
        (1_040.0, 1_100.0, "elementwise"),  # overlaps: no gap
        (1_300.0, 1_400.0, "_groups_kernel"),  # 0.2 ms after
        (6_500.0, 7_000.0, "ncclDevKernel"),  # 3 ms after the gemm
    ]
    out = stream_gaps(kernels)
    assert out[GAP_MS_PREFIX + "under_10us"] == pytest.approx(0.005) and out[GAPS_PREFIX + "under_10us"] == 1
    assert out[GAP_MS_PREFIX + "0.1_to_1ms"] == pytest.approx(0.2) and out[GAPS_PREFIX + "0.1_to_1ms"] == 1
    assert out[GAP_MS_PREFIX + "1ms_and_more"] == pytest.approx(1.6 + 3.0) and out[GAPS_PREFIX + "1ms_and_more"] == 2
    assert out[GAP_BEFORE_PREFIX + "gemm"] == pytest.approx(1.6) and out[GAP_BEFORE_PREFIX + "nccl"] == pytest.approx(
        3.0
    )
    assert out[GAP_BEFORE_KERNEL_PREFIX + "nvjet_gemm"] == pytest.approx(1.6)
    assert out[GAP_BEFORE_KERNEL_PREFIX + "ncclDevKernel"] == pytest.approx(3.0)
    assert not [k for k in out if k.startswith(GAP_BEFORE_KERNEL_PREFIX + "elementwise")]  # its gaps were short
    # seven long gaps before seven kernels, the i-th (i + 1) ms long: the five longest are named
    many = [(0.0, 1.0, "k0")] + [(1.0 + sum(range(2, i + 2)) * 1e3, 2.0 + sum(range(2, i + 2)) * 1e3, f"k{i}")
                                 for i in range(1, 8)]  # fmt: skip
    named = {
        k[len(GAP_BEFORE_KERNEL_PREFIX) :]: v
        for k, v in stream_gaps(many).items()
        if k.startswith(GAP_BEFORE_KERNEL_PREFIX)
    }
    assert sorted(named) == ["k3", "k4", "k5", "k6", "k7"], named
    assert GAP_MS_PREFIX + "10us_to_0.1ms" not in out
    assert stream_gaps([]) == {}
    assert GAP_DURING_COLLECTIVE not in out  # no collectives given (one rank)
    # collectives on other streams, overlapping each other: the gap 3.5-6.5 ms is covered from 4.0 to 5.0 ms, the gap
    # 1.4-3.0 ms from 2.9 on, the 0.2 ms gap (1.1-1.3) not at all; one ends before the first gap
    nccl = [(4_000.0, 4_600.0), (4_500.0, 5_000.0), (2_900.0, 3_200.0), (0.0, 900.0)]
    assert stream_gaps(kernels, nccl)[GAP_DURING_COLLECTIVE] == pytest.approx(1.0 + 0.1)
    assert stream_gaps(kernels, [(8_000.0, 9_000.0)])[GAP_DURING_COLLECTIVE] == 0.0


def test_the_other_kernels_are_labelled_by_what_they_compute_and_the_longest_reported() -> None:
    from types import SimpleNamespace

    from fp8rl.train.step_profile import TOP_OTHER_CALLS_PREFIX, TOP_OTHER_MS_PREFIX, kernel_label, top_kernels

    mul_bf16 = (
        "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, "
        "c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul> >(int, "
        "at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, "
        "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)"
    )
    add_f32 = (
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    )
    label = kernel_label(mul_bf16)
    # the functor and dtypes survive, namespaces and argument types go, each word once; a metric-safe name
    assert label == "vectorized_elementwise_kernel.BinaryFunctor.BFloat16.binary_internal.MulFunctor.float"
    assert kernel_label(add_f32) == "vectorized_elementwise_kernel.CUDAFunctor_add.float"
    assert kernel_label("<>") == "unnamed" and len(kernel_label("x" * 500)) == 120

    def avg(key: str, us: float, count: int) -> SimpleNamespace:
        return SimpleNamespace(key=key, self_device_time_total=us, count=count)

    events = [avg(mul_bf16, 3_000.0, 10), avg(add_f32, 5_000.0, 4), avg(add_f32 + " ", 1_000.0, 1),
              avg("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN", 9_000.0, 2), avg("idle", 0.0, 1)]  # fmt: skip
    got = top_kernels(SimpleNamespace(key_averages=lambda: events), n=1)
    add = kernel_label(add_f32)  # two names with one label are summed; GEMMs are not "other"; n=1 keeps the longest
    assert got == {TOP_OTHER_MS_PREFIX + add: 6.0, TOP_OTHER_CALLS_PREFIX + add: 5.0}
    assert len(top_kernels(SimpleNamespace(key_averages=lambda: events))) == 4


def test_every_fp8rl_quantization_kernel_is_counted_as_quantization() -> None:
    """Each Triton kernel of ``fp8rl.quant.kernels`` and ``fp8rl.quant.row_linear`` (by the name a profiler shows)
    falls in ``fp8_quantize``, so a new or renamed kernel is not filed under "other"."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from fp8rl.quant import kernels, row_linear

    names = [
        obj.fn.__name__
        for module in (kernels, row_linear)
        for obj in vars(module).values()
        if isinstance(obj, JITFunction) and obj.fn.__name__.endswith("_kernel")
    ]
    assert len(names) >= 8
    assert {n: category(n) for n in names} == dict.fromkeys(names, "fp8_quantize")
